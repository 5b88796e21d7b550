"""The pre-mapping thread racing many allocating threads never double-maps or loses a page."""

from __future__ import annotations

import random
import threading

import torch

from kvmem.memory.backends import FakeBackend
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.page_table import PageState
from kvmem.memory.storage import SlotShape


def test_premap_thread_races_allocating_threads():
    backend = FakeBackend(4096, max_delay=0.0005, seed=7)
    storage = ElasticKVStorage(2, SlotShape(2, 16, 2, 32), torch.float32, max_blocks=2048,
                               backend=backend, blocks_per_page=4, reserve_pages=4)
    q = storage.free_queue()
    geo, table = storage.geometry, storage.table
    errors: list[BaseException] = []
    lock = threading.Lock()
    held_total = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live: list[int] = []
        try:
            for _ in range(400):
                if live and rng.random() < 0.45:
                    n = rng.randint(1, len(live))
                    gone, live = live[:n], live[n:]
                    storage.on_blocks_released(gone)
                    q.push_free(gone)
                else:
                    try:
                        got = q.pop_n(rng.randint(1, 6))
                    except ValueError:
                        continue
                    storage.on_blocks_allocated(got)
                    live += got
                    # Every block this thread holds sits on a page mapped in the backend.
                    for b in live:
                        offsets = [o for o, _ in geo.regions(geo.page_of(b))]
                        assert all(o in backend.mapped for o in offsets), f"block {b} unmapped"
            with lock:
                held_total[0] += len(live)
            storage.on_blocks_released(live)
            q.push_free(live)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an allocating thread hung"
    storage.settle()
    assert not errors, errors[0]
    assert storage._premap is not None and storage._premap.error is None

    stats = storage.stats()
    mapped_in_table = {p for p, s in enumerate(table.state) if s is PageState.MAPPED}
    mapped_in_backend = {o // geo.page_slot_bytes for o in backend.mapped if o < geo.slot_bytes}
    assert mapped_in_table == mapped_in_backend  # no page lost or mapped behind the table's back
    assert stats.maps - stats.unmaps == stats.mapped_pages == len(mapped_in_table)
    assert len(backend.mapped) == geo.num_slots * stats.mapped_pages
    assert stats.free_blocks == storage.num_blocks - 1  # every block is back but the null block
    assert stats.live_blocks == 1  # only the null block
    assert stats.maps > 20 and stats.unmaps > 10  # the race really exercised both directions
    storage.close()
