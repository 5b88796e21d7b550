"""The placement's running counts (``kvmem.memory.placement``) against the same counts
worked out from its free lists and the page states, after every step of random work
through kvmem's block pool: taking, caching, freeing, evicting and giving pages back."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.cache import BlockPool
from kvmem.memory.backends import FakeBackend
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.ledger import Ledger
from kvmem.memory.page_map import OPEN, PageState
from kvmem.memory.placement import Placement
from kvmem.memory.storage import SlotShape

K = 4  # blocks per page


def expected_counts(p: Placement) -> dict:
    states, free = p.pages.state, p._free
    pages = range(len(free))
    return {
        "num_free": sum(len(f) for f in free),
        "free_on_mapped": sum(len(free[q]) for q in pages if states[q] in OPEN),
        "owed_pages": sum(1 for q in pages if states[q] not in OPEN and len(free[q]) < K),
        "taken_unmapped": sum(K - len(free[q]) for q in pages
                              if states[q] is PageState.UNMAPPED),
        "buckets": {q: len(free[q]) for q in pages if states[q] in OPEN and free[q]},
    }


def counts(p: Placement) -> dict:
    return {"num_free": p.num_free, "free_on_mapped": p.free_on_mapped,
            "owed_pages": p.owed_pages, "taken_unmapped": p.taken_unmapped,
            "buckets": {q: n for n, bucket in enumerate(p._buckets) for q in bucket}}


step = st.one_of(st.tuples(st.just("take"), st.integers(1, 9)),
                 # the free queue's own hand-out, before the pool maps what it took
                 st.tuples(st.just("queue_take"), st.integers(1, 9)),
                 st.tuples(st.just("queue_free"), st.integers(0, 1000)),
                 st.tuples(st.just("free"), st.integers(0, 1000)),
                 st.tuples(st.just("cache_and_free"), st.integers(0, 1000)),
                 st.tuples(st.just("give_back"), st.integers(1, 6)),
                 st.tuples(st.just("settle"), st.just(0)))


@settings(max_examples=100, deadline=None)
@given(st.lists(step, min_size=1, max_size=40))
def test_the_running_counts_are_the_worked_out_ones(tmp_path_factory, steps):
    ledger = Ledger(tmp_path_factory.mktemp("placement") / "l.json")
    page_bytes = 2 * K * 8192
    budget = ledger.register("e", ceiling_bytes=12 * page_bytes)
    storage = ElasticKVStorage(2, SlotShape(2, 16, 2, 32), torch.float32, max_blocks=64,
                               backend=FakeBackend(4096), blocks_per_page=K, reserve_pages=1,
                               budget=budget, start=False)
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    placement = storage.table.placement
    requests: list[list[int]] = []
    handed: list[list[int]] = []  # taken from the queue, never allocated
    queue = storage.free_queue()
    key = 0
    try:
        for op, n in steps:
            if op == "take" and pool.can_take(n):
                requests.append(pool.take_new_blocks(n, 0))
            elif op in ("free", "cache_and_free") and requests:
                blocks = requests.pop(n % len(requests))
                if op == "cache_and_free":
                    for b in blocks:
                        key += 1
                        pool.cache_block(0, b, key.to_bytes(8, "little"), None)
                pool.free_blocks(blocks)
            elif op == "queue_take" and len(queue) - queue.num_cached >= n:
                handed.append(queue.pop_n(n))
            elif op == "queue_free" and handed:
                queue.push_free(handed.pop(n % len(handed)))
            # Pre-mapping and trimming run only while no block the queue handed out waits
            # to be allocated: the pool maps those within the same allocation, and until
            # then pre-mapping would map a page beside them that trimming takes back.
            elif op == "give_back" and not handed:
                storage.give_back(n * page_bytes, evict=pool.evict_cached)
            elif op == "settle" and not handed:
                storage.settle()
            with storage.table.cond:
                assert counts(placement) == expected_counts(placement), (op, n)
    finally:
        storage.close()
