"""One elastic give-back, timed: an idle engine's answer without the engines around it.

Builds kvmem's elastic KV storage in the shape of the tests' tiny Llama (4 slots, blocks
of 16 KiB per slot, pages of one block) with a ledger in a temporary folder, fills it
with prefix-cached blocks freed request by request (57 blocks each, in random order), and
times ``give_back`` of ``--mib`` MiB: choosing the pages, evicting their blocks from the
pool, unmapping them and the ledger write. ``--profile`` prints where the time goes;
``--busy-thread`` keeps another Python thread running meanwhile (as an engine's other
threads may be), so that every call that lets go of the GIL can wait up to the
interpreter's switch interval to get it back. ``--huge-pages``: pages of whole
transparent huge pages (128 blocks, 2 MiB in each slot), as ``--kv-memory-huge-pages``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/give_back.py [--mib 20] [--rounds 8] \
        [--huge-pages]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import threading
import time

import torch

from kvmem.cache import BlockPool
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.ledger import Ledger
from kvmem.memory.storage import SlotShape

MiB = 1 << 20
REQUEST_BLOCKS = 57  # a 900-token prompt in blocks of 16


def cached_storage(seed: int, blocks: int, *,
                   huge_pages: bool = False) -> tuple[ElasticKVStorage, BlockPool]:
    """Storage whose ``blocks`` blocks all hold cached-free prefixes."""
    budget = Ledger.for_device("cpu", tempfile.mkdtemp()).register("A", ceiling_bytes=64 * MiB)
    storage = ElasticKVStorage(4, SlotShape(2, 16, 2, 64), torch.float32, max_blocks=1024,
                               budget=budget, start=False, huge_pages=huge_pages)
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    rng = random.Random(seed)
    taken = pool.take_new_blocks(blocks, 0)
    for b in taken:
        pool.cache_block(0, b, rng.getrandbits(64).to_bytes(8, "little"), None)
    requests = [taken[i:i + REQUEST_BLOCKS] for i in range(0, blocks, REQUEST_BLOCKS)]
    rng.shuffle(requests)
    for request in requests:
        pool.free_blocks(request)
    return storage, pool


def spin(done: threading.Event) -> None:
    while not done.is_set():
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=20, help="bytes to give back, in MiB")
    p.add_argument("--blocks", type=int, default=900, help="cached blocks before it")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--busy-thread", action="store_true")
    p.add_argument("--huge-pages", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    profile = cProfile.Profile() if args.profile else None
    times, given = [], 0
    for seed in range(args.rounds):
        storage, pool = cached_storage(seed, args.blocks, huge_pages=args.huge_pages)
        done = threading.Event()
        busy = threading.Thread(target=spin, args=(done,)) if args.busy_thread else None
        if busy is not None:
            busy.start()
        start = time.perf_counter()
        if profile:
            profile.enable()
        given = storage.give_back(args.mib * MiB, evict=pool.evict_cached)
        if profile:
            profile.disable()
        times.append((time.perf_counter() - start) * 1e3)
        done.set()
        if busy is not None:
            busy.join()
        storage.close()
    print(f"gave back {given / MiB:.2f} MiB; median {statistics.median(times):.2f} ms; ms: "
          + " ".join(f"{t:.2f}" for t in times))
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
