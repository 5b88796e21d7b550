"""Elastic storage wired into kvmem.cache's BlockPool: hooks, guard and cached blocks."""

from __future__ import annotations

import torch

from kvmem.cache import BlockPool
from kvmem.memory.backends import FakeBackend
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.ledger import Ledger
from kvmem.memory.storage import SlotShape

PAGE = 2 * 4 * 8192  # 2 slots x 4 blocks x 8 KiB


def make(tmp_path, limit_pages: int):
    budget = Ledger(tmp_path / "l.json").register("e", ceiling_bytes=limit_pages * PAGE)
    storage = ElasticKVStorage(2, SlotShape(2, 16, 2, 32), torch.float32, max_blocks=256,
                               backend=FakeBackend(4096), blocks_per_page=4, reserve_pages=0,
                               budget=budget, start=False)
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    return storage, pool


def test_pool_maps_on_take_and_says_no_at_the_limit(tmp_path):
    storage, pool = make(tmp_path, limit_pages=4)
    assert pool.num_free_blocks == storage.num_blocks - 1  # every block but the null block
    taken = []
    while pool.can_take(3):
        taken += pool.take_new_blocks(3, 0)
    assert len(taken) >= 12  # 4 pages of 4 blocks, minus the null block, minus the rounding
    assert storage.stats().held_bytes <= 4 * PAGE
    assert pool.num_free_blocks > 200  # the pool has blocks; the budget said no
    pool.free_blocks(taken)
    storage.settle()
    assert storage.stats().mapped_pages == 1  # only the null block's page is left
    assert pool.can_take(3)


def test_cached_blocks_are_evicted_rather_than_passing_the_limit(tmp_path):
    storage, pool = make(tmp_path, limit_pages=3)
    blocks = pool.take_new_blocks(8, 0) if pool.can_take(8) else []
    assert len(blocks) == 8
    for i, b in enumerate(blocks):
        assert pool.cache_block(0, b, bytes([i]) * 16, None)
    pool.free_blocks(blocks)  # cached-free: their pages stay mapped
    storage.settle()
    assert storage.stats().live_blocks == 9
    held = storage.stats().held_bytes
    assert pool.can_take(8)  # the budget is spent, but cached blocks can be evicted
    again = pool.take_new_blocks(8, 0)
    assert set(again) <= set(blocks) | set(range(12))
    assert storage.stats().held_bytes <= max(held, 3 * PAGE)
    assert pool.get_cached_block(0, bytes([0]) * 16) is None  # the oldest entry was evicted
