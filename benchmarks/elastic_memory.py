"""Elastic KV memory on CPU: allocation latency with and without the pre-mapped reserve,
map/unmap cost per page, and mapped/live bytes over a serving trace (page-aware placement
against a plain FIFO free queue).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/elastic_memory.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque

import torch

from kvmem.memory.backends import FakeBackend
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.storage import SlotShape

# A small Llama-like layer: 8 KV heads x 128, fp16, 16-token blocks = 64 KiB per block per slot.
SHAPE = SlotShape(2, 16, 8, 128)
SLOTS = 8


def storage(reserve_pages: int, max_blocks: int = 16384, **kw) -> ElasticKVStorage:
    return ElasticKVStorage(SLOTS, SHAPE, torch.float16, max_blocks=max_blocks,
                            reserve_pages=reserve_pages, **kw)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def allocation_latency(reserve_pages: int, rounds: int) -> tuple[float, float]:
    """Time to take one block and have its page mapped, as a decode step does.

    Without a reserve there is no pre-mapping thread, and freed pages are unmapped at once
    (outside the timed part), so every allocation maps its page on demand.
    """
    background = reserve_pages > 0
    s = storage(reserve_pages, start=background)
    q = s.free_queue()
    live: deque[int] = deque()
    times = []
    for i in range(rounds):
        if len(live) > 256:  # keep a working set; freed pages get trimmed in the background
            b = live.popleft()
            s.on_blocks_released([b])
            q.push_free([b])
            if not background:
                s.settle()
        t0 = time.perf_counter()
        s.capacity_guard(1)
        got = q.pop_n(1)
        s.on_blocks_allocated(got)
        times.append(time.perf_counter() - t0)
        live.extend(got)
        if i % 8 == 0:
            time.sleep(0.005)  # a decode step of 8 requests: the pre-mapping thread's window
    s.close()
    return pct(times, 0.5) * 1e6, pct(times, 0.99) * 1e6


def map_unmap_cost(pages: int) -> tuple[float, float, int]:
    s = storage(0)
    geo = s.geometry
    t0 = time.perf_counter()
    for p in range(1, pages + 1):
        for off, n in geo.regions(p):
            s.backend.map(off, n)
    t_map = (time.perf_counter() - t0) / pages
    t0 = time.perf_counter()
    for p in range(1, pages + 1):
        for off, n in geo.regions(p):
            s.backend.unmap(off, n)
    t_unmap = (time.perf_counter() - t0) / pages
    s.close()
    return t_map * 1e6, t_unmap * 1e6, geo.page_bytes


def serving_trace(live_requests: int, steps: int, fifo: bool, seed: int = 0) -> float:
    """Requests arrive, grow one token per step and finish at random lengths; returns the
    mean mapped/live ratio in steady state."""
    rng = random.Random(seed)
    # Bookkeeping only (FakeBackend), with CUDA's 2 MiB granularity: 32 blocks per page.
    s = storage(reserve_pages=2, max_blocks=65536, backend=FakeBackend(2 << 20), start=False)
    q = s.free_queue()
    if fifo:
        order = deque(q.pop_n(len(q)))

        def pop() -> int:
            return order.popleft()

        def push(b: int) -> None:
            order.append(b)
    else:
        def pop() -> int:
            return q.pop_n(1)[0]

        def push(b: int) -> None:
            q.push_free([b])
    reqs: list[list] = []  # [tokens, target, blocks]
    ratios = []
    for step in range(steps):
        while len(reqs) < live_requests:
            reqs.append([rng.randint(50, 400), rng.randint(500, 3000), []])
        for r in reqs:
            r[0] += 1
            while len(r[2]) * SHAPE.block_size < r[0]:
                b = pop()
                s.on_blocks_allocated([b])
                r[2].append(b)
        for r in [r for r in reqs if r[0] >= r[1]]:
            s.on_blocks_released(r[2])
            for b in r[2]:
                push(b)
            reqs.remove(r)
        s.settle()
        if step > steps // 2:
            st = s.stats()
            ratios.append(st.mapped_bytes / max(1, st.used_bytes))
    s.close()
    return statistics.mean(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"page = {storage(0).geometry.blocks_per_page} block(s) x {SLOTS} slots")
    for reserve in (0, 4):
        p50, p99 = allocation_latency(reserve, args.rounds)
        print(f"allocation, reserve {reserve} pages: p50 {p50:.1f} us  p99 {p99:.1f} us")
    t_map, t_unmap, page = map_unmap_cost(512)
    print(f"per page ({page // 1024} KiB): map {t_map:.1f} us, unmap {t_unmap:.1f} us")
    for n in (16, 64, 256):
        aware = serving_trace(n, args.steps, fifo=False)
        fifo = serving_trace(n, args.steps, fifo=True)
        print(f"{n} live requests, 2 MiB pages: mapped/live page-aware {aware:.3f}, "
              f"FIFO {fifo:.3f}")


if __name__ == "__main__":
    main()
