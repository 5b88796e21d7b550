"""Elastic KV storage: page geometry, placement, mapping hooks, budget and resident memory."""

from __future__ import annotations

import random
from collections import deque

import psutil
import pytest
import torch

from kvmem.errors import ConfigError
from kvmem.memory import reclaim
from kvmem.memory.backends import FakeBackend
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.ledger import Ledger
from kvmem.memory.page_table import OverBudgetError
from kvmem.memory.pages import PageGeometry, blocks_per_page_for
from kvmem.memory.storage import SlotShape

SHAPE = SlotShape(num_kv=2, block_size=16, num_heads=2, head_dim=32)  # 8 KiB per block in fp32


def fake_storage(max_blocks=64, blocks_per_page=4, **kw) -> ElasticKVStorage:
    kw.setdefault("start", False)
    return ElasticKVStorage(3, SHAPE, torch.float32, max_blocks=max_blocks,
                            backend=FakeBackend(4096), blocks_per_page=blocks_per_page, **kw)


def engine_a_under_a_total(tmp_path, total_pages: int, reserve_pages: int):
    """Engine "a"'s storage and block pool in a ledger whose device total is
    ``total_pages`` of its pages: (ledger, storage, page bytes, pool)."""
    from kvmem.cache import BlockPool

    ledger = Ledger(tmp_path / "l.json")
    storage = fake_storage(max_blocks=64, reserve_pages=reserve_pages,
                           budget=ledger.register("a", floor_bytes=0))
    page = storage.geometry.page_bytes
    ledger.set_total_limit(total_pages * page)
    return ledger, storage, page, BlockPool(storage.num_blocks, 1, **storage.pool_wiring())


def test_blocks_per_page_fills_whole_granules():
    assert blocks_per_page_for(24 * 1024, 4096) == 1
    assert blocks_per_page_for(24 * 1024, 2 << 20) == 256  # lcm(24 KiB, 2 MiB) = 6 MiB
    assert blocks_per_page_for(4096, 4096, min_page_bytes=64 * 1024) == 16
    geo = PageGeometry.build(num_slots=3, block_slot_bytes=24 * 1024, max_blocks=1000,
                             granularity=2 << 20)
    assert geo.num_blocks % geo.blocks_per_page == 0 and geo.num_blocks >= 1000
    regions = geo.regions(2)
    assert [o % geo.slot_bytes for o, _ in regions] == [2 * geo.page_slot_bytes] * 3
    with pytest.raises(ConfigError):
        PageGeometry.build(num_slots=1, block_slot_bytes=3000, max_blocks=8, granularity=4096,
                           blocks_per_page=1)


def test_null_block_page_is_mapped_before_the_premap_thread_starts():
    backend = FakeBackend(4096, max_delay=0.002)
    storage = ElasticKVStorage(3, SHAPE, torch.float32, max_blocks=64, backend=backend,
                               blocks_per_page=4, reserve_pages=3)
    try:
        page0 = {o for o, _ in storage.geometry.regions(0)}
        assert {off for _, off in backend.log[:3]} == page0  # first three maps: page 0, each slot
        assert 0 not in storage.free_queue().free_ids()  # the pool never hands out block 0
        storage.settle()
        # Reserve: 3 pages' worth (12) of free blocks on mapped pages: 3 on page 0 + 3 pages.
        assert storage.stats().mapped_pages == 1 + 3
    finally:
        storage.close()


def test_no_premap_thread_until_start():
    storage = fake_storage()
    assert storage.stats().mapped_pages == 1
    assert storage._premap is None
    storage.start()
    assert storage._premap is not None and storage._premap.alive
    storage.close()


def test_rank_and_world_size_are_checked():
    with pytest.raises(ConfigError):
        fake_storage(rank=2, world_size=2)
    follower = fake_storage(rank=1, world_size=2)
    assert follower.stats().mapped_pages == 0  # followers map only what rank 0 decides


def test_queue_prefers_mapped_pages_and_the_fullest_page():
    storage = fake_storage(reserve_pages=0)
    q = storage.free_queue()
    blocks = q.pop_n(11)  # page 0 (after the null block) first, then pages 1 and 2
    storage.on_blocks_allocated(blocks)
    assert blocks == list(range(1, 12))
    # Free 3 blocks on page 1 and 1 block on page 2: page 2 (fewest free) is preferred.
    for b in (4, 5, 6, 9):
        storage.on_blocks_released([b])
        q.push_free([b])
    assert q.pop_n(1) == [9]
    assert q.pop_n(1) == [4]  # then page 1, before any unmapped page
    assert q.pop_n(2) == [5, 6]
    assert q.pop_n(1) == [12]  # only now a new page


def _churn(storage, queue_pop, queue_push, steps=3000, seed=1):
    rng = random.Random(seed)
    live: list[int] = []
    ratios = []
    for step in range(steps):
        if live and (len(live) > 120 or rng.random() < 0.5):
            b = live.pop(rng.randrange(len(live)))
            storage.on_blocks_released([b])
            queue_push(b)
        else:
            n = rng.randint(1, 4)
            got = [queue_pop() for _ in range(n)]
            storage.on_blocks_allocated(got)
            live.extend(got)
        storage.settle()
        if step > 500:
            ratios.append(storage.stats().mapped_pages / max(1, len(live) / 4))
    return sum(ratios) / len(ratios)


def test_page_aware_placement_maps_fewer_pages_than_fifo():
    aware = fake_storage(max_blocks=1024, reserve_pages=1)
    q = aware.free_queue()
    aware_ratio = _churn(aware, lambda: q.pop_n(1)[0], lambda b: q.push_free([b]))

    fifo = fake_storage(max_blocks=1024, reserve_pages=1)
    fq = fifo.free_queue()
    order = deque(fq.pop_n(len(fq)))  # take every block out: a plain FIFO decides order
    fifo_ratio = _churn(fifo, order.popleft, order.append)
    assert aware_ratio < 1.5
    assert fifo_ratio > 2 * aware_ratio


def test_pages_are_released_when_blocks_free_keeping_the_reserve():
    storage = fake_storage(reserve_pages=2)
    q = storage.free_queue()
    storage.settle()
    assert storage.stats().mapped_pages == 3
    blocks = q.pop_n(40)
    storage.on_blocks_allocated(blocks)
    storage.settle()
    assert storage.stats().mapped_pages == 11 + 2  # 41 live blocks -> 11 pages, plus reserve
    storage.on_blocks_released(blocks)
    q.push_free(blocks)
    storage.settle()
    stats = storage.stats()
    assert stats.mapped_pages == 3 and stats.live_blocks == 1
    assert stats.unmaps == 10


def test_while_one_thread_gives_memory_back_no_other_trims_the_pages_it_frees():
    """The memory thread, woken by the same ask, used to trim the pages a give-back's
    evictions freed one at a time, beside the give-back's own unmap of all of them in
    runs: each page took the lock and the interpreter from the answer."""
    import threading

    storage = fake_storage(reserve_pages=0)
    q = storage.free_queue()
    blocks = q.pop_n(40)
    storage.on_blocks_allocated(blocks)
    storage.settle()
    storage.on_blocks_released(blocks)
    q.push_free(blocks)
    table = storage.table
    mapped = storage.stats().mapped_pages
    trimmed_elsewhere = []
    with table.giving_back():
        other = threading.Thread(target=lambda: trimmed_elsewhere.append(table.maintain_once()))
        other.start()
        other.join()
        assert trimmed_elsewhere == [False] and storage.stats().mapped_pages == mapped
        assert table.maintain_once()  # the giving thread trims
        assert storage.stats().mapped_pages == mapped - 1
    other = threading.Thread(target=lambda: trimmed_elsewhere.append(table.maintain_once()))
    other.start()
    other.join()
    assert trimmed_elsewhere == [False, True]  # and, once it is done, any thread again
    storage.settle()
    assert storage.stats().mapped_pages == 1  # the null block's page
    storage.close()


def take_until_refused(storage: ElasticKVStorage, queue, n: int) -> list[int]:
    """Allocate ``n`` blocks at a time, asking the capacity guard first, until it says no."""
    taken: list[int] = []
    while storage.capacity_guard(n):
        got = queue.pop_n(n)
        storage.on_blocks_allocated(got)
        taken += got
    return taken


def test_capacity_guard_says_no_at_the_limit_and_never_raises(tmp_path):
    ledger = Ledger(tmp_path / "l.json")
    page = 3 * 4 * 8192  # 3 slots x 4 blocks x 8 KiB
    budget = ledger.register("a", ceiling_bytes=5 * page)
    storage = fake_storage(budget=budget, reserve_pages=0)
    assert storage.stats().page_bytes == page
    q = storage.free_queue()
    taken = take_until_refused(storage, q, 3)
    assert len(taken) + 1 <= 5 * 4 and storage.stats().held_bytes <= 5 * page
    assert ledger.entries()[0].mapped_bytes <= 5 * page
    # Freeing makes room again.
    storage.on_blocks_released(taken[:8])
    q.push_free(taken[:8])
    assert storage.capacity_guard(3)
    # Skipping the guard at the limit is an error with a clear message, not a crash.
    more = q.pop_n(len(q))[-4:]
    with pytest.raises(OverBudgetError, match="capacity guard"):
        storage.on_blocks_allocated(more)


@pytest.mark.parametrize("seed", range(12))
def test_guarded_allocations_never_fail_whatever_background_work_runs_between(tmp_path, seed):
    """Two engines under one device total; the pre-mapping work of either may run between
    a guard's yes, taking the blocks and allocating them (as the thread can). A yes must
    hold: the credit it took is not spent on pre-mapping or handed back in between."""
    rng = random.Random(seed)
    ledger = Ledger(tmp_path / "l.json")
    page = 3 * 4 * 8192
    ledger.set_total_limit(12 * page)
    engines = []
    for name in "ab":
        storage = fake_storage(max_blocks=96, budget=ledger.register(name),
                               reserve_pages=rng.choice([0, 1, 2]))
        engines.append((storage, storage.free_queue(), []))

    def background() -> None:
        for _ in range(rng.randint(0, 3)):
            rng.choice(engines)[0].table.maintain_once()

    granted = 0
    for _ in range(600):
        storage, queue, live = rng.choice(engines)
        if live and rng.random() < 0.45:
            rng.shuffle(live)
            k = rng.randint(1, len(live))
            gone, live[:] = live[:k], live[k:]
            storage.on_blocks_released(gone)
            queue.push_free(gone)
        else:
            n = rng.randint(1, 9)
            if n <= len(queue) and storage.capacity_guard(n):
                background()
                got = queue.pop_n(n)
                background()
                storage.on_blocks_allocated(got)  # raises OverBudgetError if the yes broke
                live += got
                granted += 1
        background()
        assert sum(e.mapped_bytes for e in ledger.entries()) <= 12 * page
    assert granted > 100


def test_lowered_limit_trims_free_pages(tmp_path):
    ledger = Ledger(tmp_path / "l.json")
    page = 3 * 4 * 8192
    storage = fake_storage(budget=ledger.register("eng"), reserve_pages=6, start=True)
    try:
        storage.settle()
        assert storage.stats().mapped_pages == 7
        ledger.set_limits("eng", ceiling_bytes=3 * page)
        storage._heartbeat()
        storage.settle()
        assert storage.stats().held_bytes <= 3 * page
    finally:
        storage.close()


def test_followers_replay_the_leaders_page_map():
    leader = fake_storage(max_blocks=512, world_size=2, reserve_pages=1)
    follower = fake_storage(max_blocks=512, rank=1, world_size=2, reserve_pages=1)
    follower.apply_ops(leader.drain_ops())
    q = leader.free_queue()
    rng = random.Random(3)
    live = [0]
    for _ in range(300):
        if rng.random() < 0.55:
            got = q.pop_n(rng.randint(1, 3))
            leader.on_blocks_allocated(got)
            live += got
        elif len(live) > 1:
            b = live.pop(rng.randrange(1, len(live)))
            leader.on_blocks_released([b])
            q.push_free([b])
        leader.settle()
        follower.apply_ops(leader.drain_ops())
        assert follower.backend.mapped == leader.backend.mapped
    assert [op for op, _ in follower.backend.log] == [op for op, _ in leader.backend.log]


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_resident_memory_follows_live_blocks():
    shape = SlotShape(2, 16, 8, 64)  # 32 KiB per block per slot in fp16
    storage = ElasticKVStorage(4, shape, torch.float16, max_blocks=8192, reserve_pages=2,
                               min_page_bytes=64 * 1024)
    try:
        q = storage.free_queue()
        storage.settle()
        page = storage.stats().page_bytes
        base = rss()
        blocks = q.pop_n(1600)  # 200 MiB of KV over 4 slots
        assert storage.capacity_guard(0)
        storage.on_blocks_allocated(blocks)
        for s in range(4):
            storage.slot_tensor(s)[blocks] = 1.0
        grown = rss() - base
        live_bytes = 1600 * 4 * 32 * 1024
        assert 0.9 * live_bytes < grown < 1.1 * live_bytes + 8 * page
        storage.on_blocks_released(blocks[:800])
        q.push_free(blocks[:800])
        storage.settle()
        assert rss() - base < 0.55 * live_bytes + 8 * page
        storage.on_blocks_released(blocks[800:])
        q.push_free(blocks[800:])
        storage.settle()
        assert storage.stats().mapped_pages == 1 + 2
        assert rss() - base < 4 * page + (4 << 20)  # the reserve, plus allocator noise
        # Released pages lost their contents: the last block's page reads as zeros.
        last = blocks[-1]
        assert storage.table.state[storage.geometry.page_of(last)].name == "UNMAPPED"
        assert float(storage.slot_tensor(0)[last].abs().sum()) == 0.0
    finally:
        storage.close()


def test_importing_kvmem_memory_loads_neither_torch_nor_a_driver():
    import subprocess
    import sys

    code = ("import sys, kvmem.memory, kvmem.memory.elastic, kvmem.memory.coordinator; "
            "bad = [m for m in ('torch', 'cuda.bindings', 'kvmem.memory.cuda_vmm') "
            "if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_premap_thread_logs_an_error_and_keeps_going(caplog):
    """A failing heartbeat is logged (once per repeat window) and the thread goes on
    heartbeating, instead of stopping silently; settle() raises the error once."""
    import threading

    from kvmem.memory.premap import PremapThread

    storage = fake_storage()
    beats, failed = threading.Event(), []

    def heartbeat() -> None:
        if len(failed) < 3:
            failed.append(1)
            raise OSError(5, "ledger unreadable")
        beats.set()

    thread = PremapThread(storage.table, heartbeat=heartbeat, interval=0.01)
    try:
        with caplog.at_level("ERROR", logger="kvmem.memory"):
            thread.start()
            assert beats.wait(60) and thread.alive
        assert [r.getMessage() for r in caplog.records] == [
            "KV pre-mapping: OSError: [Errno 5] ledger unreadable (retrying every 0.01 s)"]
        with pytest.raises(OSError, match="ledger unreadable"):
            thread.settle()
        thread.settle()
    finally:
        thread.stop()
        storage.close()


def test_an_idle_storage_gives_back_what_it_caches_when_another_engine_asks(tmp_path):
    """Engine a holds pages of live, cached and free blocks and is idle; engine b needs
    room under the shared total: a's pre-mapping thread is woken by the ask, gives back
    its free pages and then its cached-only pages, least recently used first, through the
    pool (which drops their hashes), never its live blocks nor below its floor; b then
    takes the room."""
    import threading


    ledger, storage, page, pool = engine_a_under_a_total(tmp_path, 12, reserve_pages=1)
    evicted = []
    pool.evict_listener = lambda blocks: evicted.extend(b for b, _, _ in blocks)  # a tier's copy
    storage.start(reclaim=lambda n: storage.give_back(n, evict=pool.evict_cached))
    try:
        assert pool.can_take(40)
        blocks = pool.take_new_blocks(40, 0)  # 10 pages
        for i, b in enumerate(blocks):
            pool.cache_block(0, b, bytes([i]) * 16, None)
        live, first_cached, last_cached = blocks[:8], blocks[8:24], blocks[24:]
        pool.free_blocks(first_cached)  # cached first: least recently used
        pool.free_blocks(last_cached)
        storage.settle()
        held = storage.stats().held_bytes
        assert held >= 10 * page
        answered = threading.Event()
        gave_back = storage.budget.gave_back
        storage.budget.gave_back = lambda n, s, **kw: (gave_back(n, s, **kw), answered.set())
        b = ledger.register("b")
        assert not b.try_acquire(6 * page)
        assert answered.wait(5), "a never gave back"
        assert b.try_acquire(6 * page)
        stats = storage.stats()
        assert stats.held_bytes <= held - 4 * page
        assert stats.live_blocks - stats.cached_blocks == 9  # 8 live and the null: untouched
        # least recently used first: the older cached pages all went, the newest stayed
        # (page 2 is kept whole: block 8 on it is live)
        eligible_old = [b for b in first_cached if b // 4 != live[-1] // 4]
        assert set(eligible_old) <= set(evicted)
        assert not set(evicted) & set(last_cached[-8:])
        assert all(pool.get_cached_block(0, bytes([i]) * 16) is None
                   for i, blk in enumerate(blocks) if blk in evicted)
        assert stats.reclaims >= 1 and stats.reclaimed_bytes >= 4 * page
        entry = ledger.read().engines["a"]
        assert entry.reclaim_bytes == 0 and entry.reclaimed_bytes == stats.reclaimed_bytes
        assert sum(e.mapped_bytes for e in ledger.entries()) <= 12 * page
        assert storage.stats().mapped_pages * page <= stats.held_bytes  # nothing mapped back
    finally:
        storage.close()


def test_giving_back_stops_at_the_floor(tmp_path):
    from kvmem.cache import BlockPool

    ledger = Ledger(tmp_path / "l.json")
    storage = fake_storage(max_blocks=64, reserve_pages=0,
                           budget=ledger.register("a", floor_bytes=0))
    page = storage.geometry.page_bytes
    ledger.set_limits("a", floor_bytes=6 * page)
    storage.budget.report(0)  # reads its floor
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    assert pool.can_take(32)
    blocks = pool.take_new_blocks(32, 0)
    for i, b in enumerate(blocks):
        pool.cache_block(0, b, bytes([i]) * 16, None)
    pool.free_blocks(blocks)
    storage.settle()
    given = storage.give_back(100 * page, evict=pool.evict_cached)
    assert given > 0
    assert storage.stats().held_bytes >= 6 * page
    storage.close()


def test_no_cached_victims_when_no_page_is_wanted():
    from kvmem.cache import BlockPool

    storage = fake_storage(max_blocks=64, reserve_pages=0)
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    assert pool.can_take(8)
    blocks = pool.take_new_blocks(8, 0)
    for i, b in enumerate(blocks):
        pool.cache_block(0, b, bytes([i]) * 16, None)
    pool.free_blocks(blocks)
    table = storage.table
    assert len(table.cached_victims(1)) == 4  # one page of 4 cached blocks
    assert table.cached_victims(0) == [] and table.cached_victims(-3) == []
    storage.close()


def test_a_failed_map_names_the_rank_and_leaves_no_slot_of_the_page_mapped(monkeypatch):
    """KVMEM_FAULT_MAP fails the second slot's map of page 1: the error names the rank and
    the page, the first slot's region is unmapped again, and the page can be mapped later."""
    from kvmem.memory.backends import BackendError
    from kvmem.memory.faults import FailingMaps

    monkeypatch.setenv("KVMEM_FAULT_MAP", "rank=1,after=4")  # page 0: 3 maps, page 1: 1 of 3
    backend = FakeBackend(4096)
    storage = ElasticKVStorage(3, SHAPE, torch.float32, max_blocks=64, backend=backend,
                               blocks_per_page=4, rank=1, world_size=2, start=False)
    try:
        assert isinstance(storage.backend, FailingMaps)
        storage.table.map_now(0)  # a follower maps what rank 0 decides; here, by hand
        with pytest.raises(BackendError, match=r"^rank 1 of 2: KV page 1: .*injected"):
            storage.table.map_now(1)
        assert backend.mapped == {o for o, _ in storage.geometry.regions(0)}
        assert storage.stats().mapped_pages == 1
        storage.backend.left = 3
        storage.table.map_now(1)  # no double map of the region mapped before the failure
        assert storage.stats().mapped_pages == 2
    finally:
        storage.close()


def test_map_faults_are_read_per_rank():
    from kvmem.memory.faults import map_fault_after

    env = {"KVMEM_FAULT_MAP": "rank=1,after=3"}
    assert map_fault_after(1, env) == 3 and map_fault_after(0, env) is None
    assert map_fault_after(0, {"KVMEM_FAULT_MAP": "after=0"}) == 0
    assert map_fault_after(0, {}) is None
    for bad in ("after=x", "rank=1", "after=2,when=now", "after=-1"):
        with pytest.raises(ConfigError, match="expected 'after=N'"):
            map_fault_after(0, {"KVMEM_FAULT_MAP": bad})


def test_giving_back_many_pages_is_one_ledger_write_and_one_unmap_per_slot_and_run(tmp_path):
    """Another engine asked for memory: an idle engine's hundreds of free pages go back
    with one ledger write and one unmap per slot for each run of consecutive pages (it
    was one of each per page: a ledger write each, 126 ms for 7 MiB of small pages)."""
    from kvmem.cache import BlockPool
    from kvmem.memory.backends import MmapBackend

    class Counting(MmapBackend):
        unmaps: list[tuple[int, int]] = []

        def unmap(self, offset, length):
            self.unmaps.append((offset, length))
            super().unmap(offset, length)

    ledger = Ledger(tmp_path / "l.json")
    budget = ledger.register("a")
    storage = ElasticKVStorage(3, SHAPE, torch.float32, max_blocks=256, backend=Counting(),
                               blocks_per_page=1, reserve_pages=0, budget=budget, start=False)
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    blocks = pool.take_new_blocks(200, 0)
    for i, b in enumerate(blocks):
        pool.cache_block(0, b, i.to_bytes(16, "little"), None)
    pool.free_blocks(blocks)
    held = storage.stats().held_bytes
    writes = []
    change = ledger.change
    ledger.change = lambda fn: (writes.append(1), change(fn))[1]
    given = storage.give_back(150 * storage.geometry.page_bytes, evict=pool.evict_cached)
    assert given == 150 * storage.geometry.page_bytes
    assert storage.stats().held_bytes == held - given == budget.held_bytes
    assert ledger.read().engines["a"].mapped_bytes == held - given
    assert len(writes) == 1
    runs = {offset // storage.geometry.slot_bytes for offset, _ in Counting.unmaps}
    assert len(Counting.unmaps) == 3 == len(runs)  # the 150 pages are consecutive
    assert sum(length for _, length in Counting.unmaps) == given
    storage.close()


def test_a_page_costs_the_budget_every_ranks_share_where_they_are_counted_together(tmp_path):
    """A parallel engine on the CPU keeps every rank's KV in the host's memory: rank 0 takes
    a page of every rank from the ledger for each page it maps, and gives as much back."""
    ledger = Ledger(tmp_path / "l.json")
    page = 3 * 4 * 8192  # rank 0's page: 3 slots x 4 blocks x 8 KiB
    budget = ledger.register("a", ceiling_bytes=10 * page)
    storage = fake_storage(budget=budget, reserve_pages=0, ledger_page_bytes=2 * page)
    q = storage.free_queue()
    taken = take_until_refused(storage, q, 4)
    stats = storage.stats()
    assert stats.page_bytes == 2 * page and storage.nbytes == stats.mapped_pages * page
    assert stats.mapped_pages == 5  # the ceiling pays for 5 pages of both ranks
    assert ledger.entries()[0].mapped_bytes == stats.held_bytes == 10 * page
    storage.on_blocks_released(taken)
    q.push_free(taken)
    given = storage.give_back(page)  # every free page goes; the null block's stays
    assert given == 4 * 2 * page and ledger.entries()[0].mapped_bytes == 2 * page
    storage.close()


def test_the_limit_counts_every_rank_where_their_kv_shares_one_memory():
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.kv_cache_setup import plan_kv_cache
    from kvmem.memory.sizing import plan_elastic
    from kvmem.spec import load_spec

    spec = load_spec("qwen3-8b")

    def sizings(tp: int, **kw):
        config = EngineConfig(model="qwen3-8b", tensor_parallel_size=tp, max_model_len=4096,
                              kv_cache_memory_bytes="1GiB")
        planned = plan_kv_cache(spec, config, device=torch.device("cpu"),
                                kv_dtype="bfloat16", max_model_len=4096)
        return plan_elastic(planned, spec, granularity=4096, **kw)

    [one] = sizings(1)
    shared = sizings(2, one_memory=True)
    own = sizings(2)
    half = one.page_bytes // 2
    assert [s.page_bytes for s in shared] == [s.page_bytes for s in own] == [half, half]
    # the CPU: a page costs the ledger both ranks' halves, and the default limit is both
    # ranks' 1 GiB, so the engine maps as many blocks as two GiB hold of the whole model
    assert shared[0].ledger_page_bytes == one.page_bytes
    assert shared[0].limit_bytes == 2 << 30 and shared[0].limit_blocks == 2 * one.limit_blocks
    # a GPU: rank 0's own KV on its own device, under its own 1 GiB
    assert own[0].ledger_page_bytes == own[0].page_bytes
    assert own[0].limit_bytes == 1 << 30 and own[0].limit_blocks == 2 * one.limit_blocks


def _victims_by_full_scan(table, pages: int) -> list[int]:
    """``cached_victims`` by its definition: every cached block grouped by page."""
    placement, pm = table.placement, table.pages
    by_page: dict[int, list[int]] = {}
    for block in placement.cached:
        by_page.setdefault(pm.geo.page_of(block), []).append(block)
    chosen = [blocks for page, blocks in by_page.items()
              if pm.state[page].name == "MAPPED"
              and pm.live[page] == sum(pm.block_live[b] for b in blocks)]
    return [b for blocks in chosen[:max(0, pages)] for b in blocks]


@pytest.mark.parametrize("blocks_per_page", [1, 2, 4])  # 1: its own fast path
@pytest.mark.parametrize("seed", range(8))
def test_cached_victims_stop_early_yet_choose_as_a_scan_of_the_whole_cache(seed,
                                                                           blocks_per_page):
    """Requests of random lengths, some still running, freed in random order: for every
    number of pages asked, the victims (and their order) are those a scan of the whole
    cache picks."""
    from kvmem.cache import BlockPool

    rng = random.Random(seed)
    storage = fake_storage(max_blocks=128, blocks_per_page=blocks_per_page,
                           reserve_pages=0)
    pool = BlockPool(storage.num_blocks, 1, **storage.pool_wiring())
    requests = []
    while pool.can_take(8):
        blocks = pool.take_new_blocks(rng.randint(1, 8), 0)
        for b in blocks:
            if rng.random() < 0.8:
                pool.cache_block(0, b, rng.getrandbits(64).to_bytes(8, "little"), None)
        requests.append(blocks)
    rng.shuffle(requests)
    for blocks in requests[: len(requests) * 3 // 4]:  # the rest keep running
        pool.free_blocks(blocks)
    table = storage.table
    assert table.placement.cached
    for pages in range(table.geo.num_pages + 2):
        assert table.cached_victims(pages) == _victims_by_full_scan(table, pages), pages
    storage.close()


def cache_twelve_pages(storage, pool) -> None:
    """48 blocks (12 pages) taken, cached and freed: only cached blocks on those pages."""
    blocks = pool.take_new_blocks(48, 0)
    for i, b in enumerate(blocks):
        pool.cache_block(0, b, bytes([i]) * 16, None)
    pool.free_blocks(blocks)
    storage.settle()


def test_an_ask_made_while_another_is_answered_stays_asked(tmp_path):
    """An engine short of memory asks again while the first ask is being answered (its
    waiting requests' need, a millisecond after the page it maps next): the answer to
    the first clears that one only, and the second is answered next. Clearing both lost
    the second, and the idle engine kept memory the busy one waited for."""
    ledger, storage, page, pool = engine_a_under_a_total(tmp_path, 16, reserve_pages=0)

    def answer(state):
        return reclaim.answer(storage.table, storage.budget, state,
                              lambda n: storage.give_back(n, evict=pool.evict_cached))

    try:
        cache_twelve_pages(storage, pool)  # a holds 13 of the 16 pages (its null page too)
        b = ledger.register("b")
        assert not b.try_acquire(5 * page)  # asks a for 2 pages
        state = storage.budget.report(0)
        assert state.reclaim_bytes == 2 * page
        assert not b.try_acquire(8 * page)  # 3 more, asked before a's answer is written
        assert answer(state) >= 2 * page
        entry = ledger.read().engines["a"]
        assert entry.reclaim_bytes == 3 * page and entry.asked_at > 0
        held = storage.budget.held_bytes
        assert answer(storage.budget.report(0)) >= 3 * page
        assert ledger.read().engines["a"].reclaim_bytes == 0
        assert storage.budget.held_bytes <= held - 3 * page
    finally:
        storage.close()


def test_an_ask_read_again_while_it_is_answered_is_not_answered_twice(tmp_path):
    """A wake-up's heartbeat can read the ledger while the engine loop is still answering
    the ask it reads: answering that state afterwards reads the ledger again and gives
    nothing more. An ask made after the answer is answered."""

    ledger, storage, page, pool = engine_a_under_a_total(tmp_path, 16, reserve_pages=0)

    def answer(state):  # as the engine loop does, with no memory thread of its own here
        return reclaim.answer(storage.table, storage.budget, state,
                              lambda n: storage.give_back(n, evict=pool.evict_cached))

    try:
        cache_twelve_pages(storage, pool)
        b = ledger.register("b")
        assert not b.try_acquire(8 * page)  # asks a for what the total keeps from b
        budget = storage.budget
        first, second = budget.report(0), budget.report(0)  # both read before the answer
        assert first.reclaim_bytes == second.reclaim_bytes > 0
        held = budget.held_bytes
        writes = []
        write = ledger._write
        ledger._write = lambda *a: (writes.append(1), write(*a))
        assert answer(first) > 0
        ledger._write = write
        after = budget.held_bytes
        assert after < held
        assert len(writes) == 1  # the pages released and the answer, in one write
        entry = ledger.read().engines["a"]
        assert entry.mapped_bytes == after and entry.reclaim_bytes == 0
        assert answer(second) == 0 and budget.held_bytes == after
        assert not b.try_acquire(12 * page)  # a new ask, read after the answer
        assert answer(budget.report(0)) > 0 and budget.held_bytes < after
    finally:
        storage.close()
