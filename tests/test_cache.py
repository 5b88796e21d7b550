"""kvmem.cache: hashing, block pool, per-type managers, coordinator and KVCacheManager."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import xxhash

from kvmem.cache import (
    NULL_BLOCK_ID,
    BlockPool,
    FreeBlockQueue,
    KVCacheManager,
    NoCapacity,
    PrefixHit,
    hash_block_tokens,
    hash_request_tokens,
)
from kvmem.cache.coordinator import KVCacheCoordinator
from kvmem.cache.hashing import ROOT_PARENT_HASH, encode_extra_keys, extend_block_hashes
from kvmem.errors import ConfigError
from kvmem.spec import AttentionKind, KVGroup

BS = 4  # small blocks keep the scenarios readable


class Req:
    """The request protocol the manager needs."""

    def __init__(self, request_id: str, token_ids, cache_salt=None, lora_name=None):
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.cache_salt = cache_salt
        self.lora_name = lora_name

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def full(gid=0):
    return KVGroup(gid, AttentionKind.FULL, None, (gid,))


def sliding(gid, window):
    return KVGroup(gid, AttentionKind.SLIDING, window, (gid,))


def chunked(gid, chunk):
    return KVGroup(gid, AttentionKind.CHUNKED, chunk, (gid,))


def run_prompt(mgr, req, num_new=None):
    hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - hit.num_tokens if num_new is None else num_new
    return hit, mgr.allocate_slots(req, n, prefix_hit=hit)


def pool_snapshot(pool: BlockPool):
    q = pool.free_queue
    return (list(pool.ref_cnt), list(pool.hold_cnt), list(pool.block_hash),
            q.free_ids(), q.cached_ids(), sorted(pool.held_idle),
            [dict(m) for m in pool.cached], pool.epoch, len(pool.events or []))


# -- hashing -------------------------------------------------------------------------------

def test_block_hash_is_xxh3_128_over_parent_le_uint32_tokens_and_extra_keys():
    tokens = [1, 2, 70000, 2**32 - 1]
    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert hash_block_tokens(None, tokens) == xxhash.xxh3_128_digest(ROOT_PARENT_HASH + packed)
    parent = b"p" * 16
    extra = encode_extra_keys(cache_salt="tenant-a")
    assert hash_block_tokens(parent, tokens, extra) == xxhash.xxh3_128_digest(
        parent + packed + extra)
    assert len(hash_block_tokens(None, tokens)) == 16


def test_block_hashes_are_stable_across_processes():
    code = ("from kvmem.cache import hash_request_tokens; "
            "print(hash_request_tokens(list(range(100)), 16, b'x')[-1].hex())")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert outs == {hash_request_tokens(list(range(100)), 16, b"x")[-1].hex()}


def test_hashes_chain_and_cover_only_full_blocks():
    hashes = hash_request_tokens(list(range(40)), 16)
    assert len(hashes) == 2  # the last 8 tokens are not a full block
    assert hashes[1] == hash_block_tokens(hashes[0], range(16, 32))
    # the same block content after a different prefix hashes differently
    other = hash_request_tokens([99] * 16 + list(range(16, 32)), 16)
    assert other[1] != hashes[1]


def test_incremental_hashing_equals_one_shot():
    tokens = list(range(1000, 1100))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:20], 1, 8)
    extend_block_hashes(hashes, tokens, 12, 8)
    assert hashes == hash_request_tokens(tokens, 8)


def test_extra_keys_separate_tenants_and_adapters():
    tokens = list(range(16))
    plain = hash_block_tokens(None, tokens)
    salt = hash_block_tokens(None, tokens, encode_extra_keys(cache_salt="x"))
    lora = hash_block_tokens(None, tokens, encode_extra_keys(lora_name="x"))
    assert len({plain, salt, lora}) == 3


def test_bad_token_ids_are_rejected():
    with pytest.raises(ValueError):
        hash_block_tokens(None, [-1, 2])
    with pytest.raises(ValueError):
        hash_block_tokens(None, [2**32])
    with pytest.raises(ValueError, match="need"):
        extend_block_hashes([], [1, 2], 3, 2)  # not enough tokens for 3 blocks
    for bad in ([-1, 2], [2**32, 2], [1.5, 2]):  # one new block takes its own packing path
        with pytest.raises(ValueError, match="integers"):
            extend_block_hashes([], bad, 1, 2)
        with pytest.raises(ValueError, match="integers"):
            extend_block_hashes([], bad * 2, 2, 2)


def test_hashing_one_block_at_a_time_equals_one_shot():
    tokens = [7, 2**32 - 1, 0, 65536] * 10
    for extra in (b"", encode_extra_keys(cache_salt="t", lora_name="a")):
        hashes: list[bytes] = []
        for num_blocks in range(1, 11):
            extend_block_hashes(hashes, tokens, num_blocks, 4, extra)
        assert hashes == hash_request_tokens(tokens, 4, extra)
        assert hashes[3] == hash_block_tokens(hashes[2], tokens[12:16], extra)


# -- block pool ----------------------------------------------------------------------------

def test_null_block_is_never_handed_out():
    pool = BlockPool(6)
    ids = pool.take_new_blocks(5, 0)
    assert sorted(ids) == [1, 2, 3, 4, 5] and NULL_BLOCK_ID not in ids
    assert not pool.can_take(1)
    pool.free_blocks([NULL_BLOCK_ID, *ids])  # the null block is ignored
    assert pool.ref_cnt[NULL_BLOCK_ID] == 0 and pool.usage().free == 5


def test_freeing_more_often_than_taken_is_refused():
    pool = BlockPool(4)
    a, b = pool.take_new_blocks(2, 0)
    pool.touch([a])  # a second table holds block a
    pool.free_blocks([a, b])
    assert pool.ref_cnt[a] == 1 and pool.ref_cnt[b] == 0 and pool.usage().free == 2
    with pytest.raises(ValueError, match="more often"):
        pool.free_blocks([b])


def test_uncached_free_blocks_are_reused_before_cached_ones_and_cached_evict_lru():
    pool = BlockPool(7)
    ids = pool.take_new_blocks(6, 0)
    for i, block_id in enumerate(ids[:4]):
        pool.cache_block(0, block_id, bytes([i]) * 16, None)
    pool.free_blocks([ids[0], ids[1], ids[4], ids[2], ids[3], ids[5]])
    assert pool.usage().cached == 4 and pool.usage().free == 2
    first = pool.take_new_blocks(2, 0)
    assert sorted(first) == sorted([ids[4], ids[5]])  # no cached data lost yet
    assert pool.usage().cached == 4
    evicted = pool.take_new_blocks(2, 0)
    assert evicted == [ids[0], ids[1]]  # freed first, evicted first
    assert pool.free_queue.cached_ids() == [ids[2], ids[3]]
    assert pool.get_cached_block(0, bytes([0]) * 16) is None
    assert pool.get_cached_block(0, bytes([2]) * 16) == ids[2]


def test_touch_takes_a_cached_free_block_out_of_the_queue():
    pool = BlockPool(3)
    a, b = pool.take_new_blocks(2, 0)
    pool.cache_block(0, a, b"a" * 16, None)
    pool.free_blocks([a])
    assert pool.free_queue.is_cached(a)
    pool.touch([a])
    assert pool.ref_cnt[a] == 1 and not pool.free_queue.is_cached(a)
    assert pool.usage().used == 2 and pool.usage().cached == 0


def test_holds_keep_blocks_neither_free_nor_evictable():
    pool = BlockPool(4)
    a, b, c = pool.take_new_blocks(3, 0)
    pool.cache_block(0, a, b"a" * 16, None)
    pool.hold([a, b])
    pool.hold([a])  # holds nest
    pool.free_blocks([a, b, c])
    u = pool.usage()
    assert (u.used, u.held, u.free, u.cached) == (0, 2, 1, 0)
    assert not pool.can_take(2)
    pool.release([a, b])
    u = pool.usage()
    assert (u.held, u.free, u.cached) == (1, 2, 0)  # b free, a still held once
    pool.release([a])
    assert pool.usage().cached == 1 and pool.can_take(3)
    with pytest.raises(ValueError, match="not held|more often"):
        pool.release([a])
    with pytest.raises(ValueError, match="free"):
        pool.hold([b])  # free, no data
    with pytest.raises(ValueError, match="outside"):
        pool.hold([0])


def test_hold_on_cached_free_block_removes_it_from_the_lru():
    pool = BlockPool(3)
    a, b = pool.take_new_blocks(2, 0)
    pool.cache_block(0, a, b"a" * 16, None)
    pool.free_blocks([a, b])
    pool.hold([a])
    assert pool.usage().held == 1 and pool.usage().cached == 0
    assert pool.take_new_blocks(1, 0) == [b]
    assert not pool.can_take(1)
    assert pool.get_cached_block(0, b"a" * 16) == a  # still findable while held


def test_free_queue_lru_matches_a_plain_list_model():
    """The LRU's linked lists stay consistent under pushes, removals from anywhere and
    pops of one or many blocks across both parts of the queue."""
    import random

    rng = random.Random(0)
    queue = FreeBlockQueue(range(1, 65))
    free, lru = list(range(1, 65)), []  # the model: free stack (lowest first), LRU order
    used: list[int] = []
    for _ in range(3000):
        op = rng.randrange(4)
        if op == 0 and len(free) + len(lru):  # pop one or many
            n = rng.choice([1, 1, rng.randint(1, len(free) + len(lru))])
            expected = free[:n] + lru[:max(0, n - len(free))]
            del lru[:max(0, n - len(free))]
            del free[:n]
            assert queue.pop_n(n) == expected
            used += expected
        elif op == 1 and used:  # some used blocks become cached-free, in order
            run = rng.sample(used, rng.randint(1, len(used)))
            used = [b for b in used if b not in run]
            queue.push_cached(run)
            lru += run
        elif op == 2 and lru:  # a prefix hit revives cached-free blocks
            hit = rng.sample(lru, rng.randint(1, min(3, len(lru))))
            queue.remove_cached(hit)
            lru = [b for b in lru if b not in hit]
            used += hit
        elif op == 3 and used:  # uncached blocks go to the front
            run = used[-rng.randint(1, len(used)):]
            del used[-len(run):]
            queue.push_free(run)
            free = run + free
        assert queue.cached_ids() == lru and queue.free_ids()[::-1] == free
        assert (queue.num_cached, queue.num_free, len(queue)) == (len(lru), len(free),
                                                                  len(lru) + len(free))
        assert all(queue.is_cached(b) for b in lru) and not any(map(queue.is_cached, used))
    with pytest.raises(ValueError, match="only"):
        queue.pop_n(len(queue) + 1)
    if used:
        with pytest.raises(KeyError):
            queue.remove_cached([used[0]])  # not in the LRU


def test_listeners_guard_and_evict_listener():
    pool = BlockPool(4)
    calls = []
    pool.add_listener(SimpleNamespace(
        on_blocks_allocated=lambda ids: calls.append(("alloc", list(ids))),
        on_blocks_released=lambda ids: calls.append(("release", list(ids)))))
    a, b = pool.take_new_blocks(2, 0)
    pool.cache_block(0, a, b"a" * 16, None)
    pool.free_blocks([a, b])
    assert calls == [("alloc", [a, b]), ("release", [b])]  # a is cached, not released
    seen = []
    pool.evict_listener = seen.append  # once per take, before the take returns
    pool.take_new_blocks(3, 0)
    assert seen == [[(a, 0, b"a" * 16)]]
    assert pool.get_cached_block(0, b"a" * 16) is None
    pool.free_blocks([1, 2, 3])
    pool.capacity_guard = lambda n: n <= 1
    assert pool.can_take(1) and not pool.can_take(2)


def test_evict_cached_tells_the_listener_once_of_the_blocks_no_copy_keeps():
    """A give-back's eviction: one call for all its blocks; a block whose content a copy
    still keeps cached is not among them until that copy goes too."""
    pool = BlockPool(8)
    a, b, c = pool.take_new_blocks(3, 0)
    pool.cache_block(0, a, b"a" * 16, None)
    pool.cache_block(0, b, b"b" * 16, None)
    pool.cache_block(0, c, b"a" * 16, None)  # a copy of a's content
    pool.free_blocks([a, b, c])
    seen = []
    pool.evict_listener = seen.append
    assert pool.evict_cached([a, b]) == 2
    assert seen == [[(b, 0, b"b" * 16)]]  # c still keeps a's content cached
    assert pool.get_cached_block(0, b"a" * 16) == c
    assert pool.evict_cached([c]) == 1
    assert seen[-1] == [(c, 0, b"a" * 16)]


def test_events_and_reset_prefix_cache():
    pool = BlockPool(3)
    a, b = pool.take_new_blocks(2, 0)
    pool.cache_block(0, a, b"a" * 16, None)
    pool.cache_block(0, b, b"b" * 16, b"a" * 16)
    assert not pool.cache_block(0, a, b"b" * 16, None)  # hash already cached elsewhere
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks([b, a])
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    assert [(e.kind, e.block_id) for e in events] == [
        ("stored", a), ("stored", b), ("removed", b), ("removed", a)]
    assert events[1].parent_hash == b"a" * 16
    assert pool.usage().free == 2 and pool.get_cached_block(0, b"a" * 16) is None
    assert pool.take_events() == []


def test_events_nobody_takes_are_bounded_and_counted():
    pool = BlockPool(64, max_events=10)
    ids = pool.take_new_blocks(63, 0)
    table_hashes = [bytes([i]) * 16 for i in range(63)]
    pool.cache_table_blocks(0, ids, table_hashes, 0, 63)
    assert len(pool.events) <= 10 and pool.events_dropped == 63 - len(pool.events)
    assert pool.events[-1].block_hash == table_hashes[-1]  # the newest are kept


# -- per-type managers and the coordinator -------------------------------------------------

def cached_pool(groups, cache_plan, num_blocks=64):
    """A pool whose group ``g`` has cached-free blocks for the block indices in
    ``cache_plan[g]`` of the token sequence 0..; returns (coordinator, hashes)."""
    pool = BlockPool(num_blocks, len(groups))
    coord = KVCacheCoordinator(groups, pool, BS)
    hashes = hash_request_tokens(list(range(200)), BS)
    for g, indices in enumerate(cache_plan):
        for i in indices:
            (block_id,) = pool.take_new_blocks(1, g)
            pool.cache_block(g, block_id, hashes[i], None)
            pool.free_blocks([block_id])
    return coord, hashes


def test_full_attention_hit_is_the_contiguous_prefix():
    coord, hashes = cached_pool([full()], [[0, 1, 2, 4, 5]])
    n, (blocks,) = coord.find_longest_cache_hit(hashes, 10)
    assert n == 3 and len(blocks) == 3 and NULL_BLOCK_ID not in blocks
    assert coord.find_longest_cache_hit(hashes, 2)[0] == 2


def test_sliding_window_hit_needs_only_the_last_window():
    # window 9: the next token needs the 8 tokens before it = the last 2 blocks
    coord, hashes = cached_pool([sliding(0, 9)], [[3, 4, 7, 8]])
    n, (blocks,) = coord.find_longest_cache_hit(hashes, 20)
    assert n == 9
    assert blocks[:7] == [NULL_BLOCK_ID] * 7 and NULL_BLOCK_ID not in blocks[7:]
    assert coord.find_longest_cache_hit(hashes, 8)[0] == 5  # blocks 3, 4
    assert coord.find_longest_cache_hit(hashes, 4)[0] == 0  # block 2 missing, 0..1 too


def test_sliding_window_hit_from_the_start_when_shorter_than_the_window():
    coord, hashes = cached_pool([sliding(0, 64)], [[0, 1, 2]])
    n, (blocks,) = coord.find_longest_cache_hit(hashes, 10)
    assert n == 3 and NULL_BLOCK_ID not in blocks


def test_chunked_local_hit_needs_only_the_current_chunk():
    # chunk 16 tokens = 4 blocks: a hit of L blocks needs blocks L//4*4 .. L-1
    coord, hashes = cached_pool([chunked(0, 16)], [[8, 9]])
    n, (blocks,) = coord.find_longest_cache_hit(hashes, 11)
    assert n == 10 and blocks == [NULL_BLOCK_ID] * 8 + blocks[8:]
    # with nothing cached a hit may still end on a chunk boundary
    assert coord.find_longest_cache_hit(hashes, 7)[0] == 4


def test_coordinator_finds_a_length_valid_for_every_group():
    # full attention has blocks 0..9; the window (2 blocks) is cached only at 5..6
    coord, hashes = cached_pool([full(0), sliding(1, 9)], [range(10), [5, 6]])
    n, (f, s) = coord.find_longest_cache_hit(hashes, 12)
    assert n == 7 and len(f) == len(s) == 7
    assert s[:5] == [NULL_BLOCK_ID] * 5 and NULL_BLOCK_ID not in s[5:]
    # the full group limits the sliding group too
    coord, hashes = cached_pool([full(0), sliding(1, 9)], [range(4), [5, 6]])
    assert coord.find_longest_cache_hit(hashes, 12)[0] == 0


# -- KVCacheManager ------------------------------------------------------------------------

def test_allocate_covers_tokens_and_decode_grows_one_block_at_a_time():
    mgr = KVCacheManager([full()], 32, BS)
    req = Req("a", range(10))
    hit, res = run_prompt(mgr, req)
    assert hit.num_tokens == 0 and res and len(res.new_block_ids[0]) == 3
    for token in range(10, 20):
        req.all_token_ids.append(token)
        res = mgr.allocate_slots(req, 1)
        assert res and len(mgr.get_block_ids("a")[0]) == -(-(token + 1) // BS)
    assert mgr.num_computed_tokens("a") == 20
    res = mgr.allocate_slots(req, 0, num_lookahead_tokens=5)
    assert len(res.new_block_ids[0]) == 2 and mgr.num_computed_tokens("a") == 20


def test_prefix_hit_across_requests_and_never_the_whole_prompt():
    mgr = KVCacheManager([full()], 32, BS)
    a = Req("a", range(12))
    run_prompt(mgr, a)
    mgr.free(a)
    b = Req("b", list(range(12)))  # identical prompt: the last block must be recomputed
    hit, res = run_prompt(mgr, b)
    assert hit.num_tokens == 8 and res.num_computed_tokens == 8
    assert mgr.get_block_ids("b")[0][:2] == hit.blocks[0]
    c = Req("c", list(range(9)) + [500, 501, 502])
    assert mgr.get_computed_blocks(c).num_tokens == 8


def test_lookup_changes_nothing():
    mgr = KVCacheManager([full(), sliding(1, 9)], 32, BS)
    a = Req("a", range(30))
    run_prompt(mgr, a)
    mgr.free(a)
    before = pool_snapshot(mgr.pool)
    hit = mgr.get_computed_blocks(Req("b", range(30)))
    assert hit.num_tokens == 28
    assert pool_snapshot(mgr.pool) == before and not mgr.has_request("b")


def test_no_capacity_is_typed_falsy_and_changes_nothing():
    mgr = KVCacheManager([full(), sliding(1, 9)], 12, BS)
    a = Req("a", range(20))
    assert run_prompt(mgr, a)[1]  # 5 + 5 blocks of 11
    before = pool_snapshot(mgr.pool)
    res = mgr.allocate_slots(Req("b", range(100, 120)), 20)
    assert isinstance(res, NoCapacity) and not res and res.can_ever_fit
    assert res.needed_blocks == 10 and res.available_blocks == 1
    assert pool_snapshot(mgr.pool) == before and not mgr.has_request("b")
    huge = mgr.allocate_slots(Req("c", range(400)), 400)
    assert not huge and not huge.can_ever_fit


def test_capacity_counts_cached_free_blocks_a_hit_revives():
    mgr = KVCacheManager([full()], 7, BS)  # 6 usable blocks
    a = Req("a", range(16))
    run_prompt(mgr, a, 16)
    mgr.free(a)  # 4 cached-free blocks, 2 free
    c = Req("c", range(100, 108))
    assert run_prompt(mgr, c)[1]  # takes the 2 free blocks
    b = Req("b", list(range(16)) + list(range(200, 205)))
    hit = mgr.get_computed_blocks(b)
    assert hit.num_tokens == 16
    # 2 new blocks + reviving the 4 hit blocks = 6 > 4 available
    before = pool_snapshot(mgr.pool)
    res = mgr.allocate_slots(b, b.num_tokens - 16, prefix_hit=hit)
    assert not res and res.needed_blocks == 6 and res.available_blocks == 4
    assert pool_snapshot(mgr.pool) == before
    mgr.free(c)
    res = mgr.allocate_slots(b, b.num_tokens - 16, prefix_hit=hit)
    assert res and mgr.get_block_ids("b")[0][:4] == hit.blocks[0]


def test_stale_prefix_hit_is_refused_without_changes():
    mgr = KVCacheManager([full()], 5, BS)  # 4 usable
    a = Req("a", range(12))
    run_prompt(mgr, a)
    mgr.free(a)
    b = Req("b", range(13))
    hit = mgr.get_computed_blocks(b)
    assert hit.num_tokens == 12
    run_prompt(mgr, Req("x", range(500, 516)))  # evicts all of a's blocks
    before = pool_snapshot(mgr.pool)
    res = mgr.allocate_slots(b, 1, prefix_hit=hit)
    assert not res and "stale" in res.reason and pool_snapshot(mgr.pool) == before


def test_free_releases_tail_first_so_prefixes_survive_longest():
    mgr = KVCacheManager([full()], 5, BS)
    a = Req("a", range(16))
    run_prompt(mgr, a, 16)
    mgr.free(a)
    run_prompt(mgr, Req("x", range(900, 903)))  # needs one block: evicts a's tail
    assert mgr.get_computed_blocks(Req("b", range(17))).num_tokens == 12


def test_sliding_window_blocks_leave_the_table_and_return_to_the_pool():
    mgr = KVCacheManager([full(0), sliding(1, 9)], 40, BS)
    req = Req("a", range(8))
    run_prompt(mgr, req)
    for token in range(8, 40):
        req.all_token_ids.append(token)
        assert mgr.allocate_slots(req, 1)
    full_table, window_table = mgr.get_block_ids("a")
    assert len(full_table) == len(window_table) == 10
    # 39 computed: the next token needs positions 31..39 = blocks 7..9; 0..6 are null
    assert window_table[:7] == [NULL_BLOCK_ID] * 7 and NULL_BLOCK_ID not in window_table[7:]
    assert NULL_BLOCK_ID not in full_table
    assert mgr.usage().used == 10 + 3


def test_chunked_local_blocks_before_the_current_chunk_are_released():
    mgr = KVCacheManager([chunked(0, 8)], 40, BS)
    req = Req("a", range(4))
    run_prompt(mgr, req)
    for token in range(4, 21):
        req.all_token_ids.append(token)
        assert mgr.allocate_slots(req, 1)
    # 20 computed; the next token (position 20) is in chunk 16..23: blocks 0..3 released
    assert mgr.get_block_ids("a")[0][:4] == [NULL_BLOCK_ID] * 4
    assert mgr.usage().used == 2


def test_hybrid_prefix_hit_follows_window_rules_end_to_end():
    mgr = KVCacheManager([full(0), sliding(1, 9)], 64, BS)
    a = Req("a", range(40))
    hit, res = run_prompt(mgr, a)
    mgr.free(a)
    b = Req("b", list(range(40)) + [7, 7, 7])
    hit = mgr.get_computed_blocks(b)
    assert hit.num_tokens == 40
    assert hit.blocks[1][:8] == [NULL_BLOCK_ID] * 8
    res = mgr.allocate_slots(b, b.num_tokens - 40, prefix_hit=hit)
    assert res and mgr.get_block_ids("b")[0][:10] == hit.blocks[0]


def test_mission_problem_3_held_blocks_are_not_free_and_running_out_is_typed():
    """A hybrid pool; request A fills most of it and finishes while a transfer still holds
    its blocks; request B of the same size gets NoCapacity, then succeeds after release."""
    groups = [full(0), sliding(1, 16)]
    mgr = KVCacheManager(groups, 101, BS, max_num_batched_tokens=32)
    prompt = 300  # 75 full-attention blocks + a few window blocks, of 100
    a = Req("a", range(prompt))
    for start in range(0, prompt, 32):  # chunked prefill
        assert mgr.allocate_slots(a, min(32, prompt - start))
    used_by_a = mgr.usage().used
    assert used_by_a > 75
    in_flight = [b for table in mgr.get_block_ids("a") for b in table if b]
    mgr.hold(in_flight)  # an asynchronous store copies A's blocks out
    mgr.free(a)
    u = mgr.usage()
    assert u.held == len(in_flight) and u.used == 0
    assert u.free + u.cached + u.held == u.total

    b = Req("b", range(10_000, 10_000 + prompt))
    covered = 0
    while covered < prompt:
        res = mgr.allocate_slots(b, min(32, prompt - covered))
        if not res:
            break
        covered += min(32, prompt - covered)
    assert isinstance(res, NoCapacity) and res.can_ever_fit
    assert "held by transfers" in res.reason and covered < prompt
    # no partial allocation: B's tables cover exactly what succeeded, in every group
    tables = mgr.get_block_ids("b")
    assert len(tables[0]) == len(tables[1]) == -(-covered // BS)
    assert mgr.num_computed_tokens("b") == covered

    mgr.release(in_flight)
    while covered < prompt:
        assert mgr.allocate_slots(b, min(32, prompt - covered))
        covered += min(32, prompt - covered)
    assert len(mgr.get_block_ids("b")[0]) == prompt // BS


def test_capacity_guard_gives_no_capacity_not_an_error():
    mgr = KVCacheManager([full()], 32, BS)
    mgr.pool.capacity_guard = lambda n: mgr.usage().used + n <= 3
    assert run_prompt(mgr, Req("a", range(12)))[1]
    res = run_prompt(mgr, Req("b", range(100, 104)))[1]
    assert not res and "limit" in res.reason


def test_events_carry_the_request_block_hashes():
    mgr = KVCacheManager([full()], 32, BS)
    a = Req("a", range(10), cache_salt="t1")
    run_prompt(mgr, a)
    events = mgr.take_events()
    expected = hash_request_tokens(range(10), BS, encode_extra_keys(cache_salt="t1"))
    assert [e.block_hash for e in events] == expected and {e.kind for e in events} == {"stored"}
    assert [e.block_id for e in events] == mgr.get_block_ids("a")[0][:2]
    assert mgr.lookup_hash(0, expected[1]) == events[1].block_id


def test_cache_salt_and_adapter_isolate_prefixes():
    mgr = KVCacheManager([full()], 32, BS)
    run_prompt(mgr, Req("a", range(20), cache_salt="t1"))
    assert mgr.get_computed_blocks(Req("b", range(20), cache_salt="t2")).num_tokens == 0
    assert mgr.get_computed_blocks(Req("c", range(20), lora_name="t1")).num_tokens == 0
    assert mgr.get_computed_blocks(Req("d", range(20), cache_salt="t1")).num_tokens == 16


def test_prefix_caching_off_means_no_hits_and_no_hashes():
    mgr = KVCacheManager([full()], 32, BS, enable_prefix_caching=False)
    run_prompt(mgr, Req("a", range(20)))
    assert mgr.take_events() == [] and mgr.usage().cached == 0
    mgr.free("a")
    assert mgr.get_computed_blocks(Req("b", range(20))).num_tokens == 0


def test_preempted_request_restarts_from_its_own_cached_blocks():
    mgr = KVCacheManager([full()], 32, BS)
    req = Req("a", range(10))
    req.block_hashes = []
    run_prompt(mgr, req)
    for token in range(10, 14):
        req.all_token_ids.append(token)
        mgr.allocate_slots(req, 1)
    assert len(req.block_hashes) == 3  # filled by the manager, kept on the request
    mgr.free(req)  # preempted
    hit, res = run_prompt(mgr, req)
    assert hit.num_tokens == 12 and res and mgr.num_computed_tokens("a") == 14


def test_caching_via_cache_blocks_and_duplicates_are_cached_copies():
    mgr = KVCacheManager([full()], 32, BS)
    a, b = Req("a", range(8)), Req("b", range(8))
    assert mgr.allocate_slots(a, 8) and mgr.allocate_slots(b, 8)  # no hit used: same data
    events = mgr.take_events()
    assert len(events) == 2  # b's identical blocks are copies: no second "stored"
    mgr.free(a)
    mgr.free(b)
    assert mgr.usage().cached == 4  # as in vLLM, both copies stay findable
    mgr.cache_blocks(a, 8)  # nothing new to cache
    assert mgr.take_events() == []
    a_blocks = [mgr.lookup_hash(0, h) for h in hash_request_tokens(list(range(8)), BS)]
    # the first copies are evicted first; the second copies take their place
    taken = mgr.pool.take_new_blocks(27 + 2, 0)
    assert set(a_blocks) <= set(taken)
    assert mgr.take_events() == []  # the content is still cached
    b_blocks = [mgr.lookup_hash(0, h) for h in hash_request_tokens(list(range(8)), BS)]
    assert None not in b_blocks and not set(b_blocks) & set(a_blocks)
    hit = mgr.get_computed_blocks(Req("c", range(9)))
    assert hit.num_tokens == 8 and hit.blocks[0] == b_blocks
    mgr.pool.take_new_blocks(2, 0)  # the last copies go: now the content is evicted
    assert [e.kind for e in mgr.take_events()] == ["evicted", "evicted"]
    assert mgr.get_computed_blocks(Req("c", range(9))).num_tokens == 0


def test_prefix_hit_only_on_first_allocation():
    mgr = KVCacheManager([full()], 32, BS)
    run_prompt(mgr, Req("a", range(12)))
    b = Req("b", range(12))
    mgr.allocate_slots(b, 4)
    with pytest.raises(ValueError):
        mgr.allocate_slots(b, 4, prefix_hit=PrefixHit(8, ([1, 2],), [], mgr.pool.epoch))


def test_from_plan_can_fit_and_config_errors():
    groups = [full(0), sliding(1, 8)]
    plan = SimpleNamespace(engine=SimpleNamespace(num_blocks=50, block_size=BS))
    mgr = KVCacheManager.from_plan(groups, plan, max_num_batched_tokens=8)
    assert mgr.num_blocks == 50 and mgr.block_size == BS and mgr.usage().total == 49
    assert mgr.can_fit(150) and not mgr.can_fit(250)  # full needs 38 / 63, window 5
    with pytest.raises(ConfigError):
        KVCacheManager([], 10)
    with pytest.raises(ConfigError):
        KVCacheManager([full(1)], 10)
    with pytest.raises(ConfigError):
        KVCacheManager([full()], 1)


def test_pool_is_sized_by_the_planner():
    from kvmem.plan import EngineSettings, Layout, plan
    from kvmem.spec import load_spec

    spec = load_spec("google/gemma-3-4b-it")
    p = plan(spec, Layout(), EngineSettings(kv_cache_memory_bytes=1 << 30, max_model_len=4096))
    mgr = KVCacheManager.from_plan(spec.kv_groups(), p)
    assert mgr.num_blocks == p.engine.num_blocks and mgr.pool.num_blocks == p.engine.num_blocks
    assert mgr.usage().total == p.engine.num_blocks - 1  # block 0 is the null block
    assert len(mgr.groups) == len(spec.kv_groups()) > 1


def test_usage_fraction_and_reset_through_manager():
    mgr = KVCacheManager([full()], 11, BS)
    a = Req("a", range(20))
    run_prompt(mgr, a)
    u = mgr.usage()
    assert (u.used, u.total) == (5, 10) and u.fraction_used == 0.5
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.usage().fraction_used == 0.0 and mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(Req("b", range(20))).num_tokens == 0


def test_cache_imports_no_torch():
    code = "import sys, kvmem.cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert out == "False"


# -- the flat decode path --------------------------------------------------------------------

class _Recorder:
    def __init__(self, log: list) -> None:
        self.log = log

    def on_blocks_allocated(self, ids):
        self.log.append(("allocated", list(ids)))

    def on_blocks_released(self, ids):
        self.log.append(("released", list(ids)))


class _OtherQueue(FreeBlockQueue):
    """The pool's queue under another type: the pool's and the manager's loops over the
    queue's own lists stay unused."""


def _wired_manager(flat: bool, log: list, limit: list[int], wired: bool = True,
                   own_queue: bool = True) -> KVCacheManager:
    queue = FreeBlockQueue(range(1, 20)) if own_queue else _OtherQueue(range(1, 20))
    pool = BlockPool(20, 1, enable_events=wired, free_queue=queue)
    mgr = KVCacheManager([full()], 20, BS, max_num_batched_tokens=16, pool=pool)
    mgr._flat_decode = flat  # the general path when False
    if not wired:  # a bare pool: decode steps take their block inline
        return mgr
    pool = mgr.pool
    pool.add_listener(_Recorder(log))
    pool.evict_listener = lambda evicted: log.extend(("evict", b, h) for b, _, h in evicted)
    pool.capacity_guard = lambda n: log.append(("guard", n)) or pool.usage().used + n <= limit[0]
    return mgr


def _outcome(res):
    if res:
        return ("ok", res.new_block_ids, res.num_computed_tokens)
    return ("no", res.reason, res.needed_blocks, res.available_blocks, res.can_ever_fit)


@pytest.mark.parametrize("wired", [True, False], ids=["hooks", "bare"])
def test_flat_decode_path_matches_the_general_path(wired):
    """One full-attention group takes the flat path for a request's first allocation and
    its later ones; the same random walk on a manager forced onto the general path must
    give identical results, pool state, events, listener calls, guard calls and evictions,
    running out of blocks often. Bare (no events, listeners or guard), a one-block step
    takes and evicts its block inline, and the pool takes and frees blocks in single passes
    over its queue's lists: a third walk runs the general path over another queue type."""
    import random

    rng = random.Random(7)
    prefixes = [list(range(12)), [5] * 9]
    walks = []
    variants = [(True, True), (False, True)] + ([] if wired else [(False, False)])
    for flat, own_queue in variants:
        log: list = []
        limit = [19]
        mgr = _wired_manager(flat, log, limit, wired, own_queue)
        rng.seed(7)
        running: dict[str, Req] = {}
        holds: list[list[int]] = []
        outcomes = []
        for step in range(3000):
            action = rng.random()
            if action < 0.2:  # a new request, first chunk of its prompt
                prompt = rng.choice(prefixes + [[]]) + [rng.randrange(20) for _ in
                                                         range(rng.randrange(1, 12))]
                req = Req(f"r{step}", prompt, cache_salt=rng.choice([None, "t"]))
                hit = mgr.get_computed_blocks(req)
                n = min(rng.randint(1, 16), req.num_tokens - hit.num_tokens)
                res = mgr.allocate_slots(req, n, prefix_hit=hit)
                outcomes.append(_outcome(res))
                if res:
                    running[req.request_id] = req
            elif action < 0.65 and running:  # the rest of the prompt, or a decode step
                req = running[rng.choice(sorted(running))]
                done = mgr.num_computed_tokens(req.request_id)
                lookahead = rng.choice([0, 0, 0, 2, 5])
                if done < req.num_tokens:
                    res = mgr.allocate_slots(req, min(rng.randint(1, 8), req.num_tokens - done),
                                             num_lookahead_tokens=lookahead)
                else:
                    req.all_token_ids.extend(rng.randrange(20) for _ in range(rng.choice([1, 4])))
                    res = mgr.allocate_slots(req, req.num_tokens - done,
                                             num_lookahead_tokens=lookahead)
                    if not res:
                        del req.all_token_ids[done:]
                outcomes.append(_outcome(res))
            elif action < 0.78 and running:  # finish or preempt
                mgr.free(running.pop(rng.choice(sorted(running))))
            elif action < 0.84 and running:
                req = running[rng.choice(sorted(running))]
                ids = mgr.get_block_ids(req.request_id)[0][::2]
                mgr.hold(ids)
                holds.append(ids)
            elif action < 0.9 and holds:
                mgr.release(holds.pop(rng.randrange(len(holds))))
            elif action < 0.95:
                limit[0] = rng.choice([6, 12, 19, 19])
            elif running:
                req = running[rng.choice(sorted(running))]
                mgr.cache_blocks(req, mgr.num_computed_tokens(req.request_id))
            outcomes.append((pool_snapshot(mgr.pool), {
                rid: (mgr.get_block_ids(rid), mgr.num_computed_tokens(rid)) for rid in running}))
        walks.append((outcomes, mgr.take_events(), log, mgr.pool.epoch))
    flat_walk = walks[0]
    for general_walk in walks[1:]:
        assert flat_walk[0] == general_walk[0]
        assert flat_walk[1:] == general_walk[1:]
    kinds = [o[0] for o in flat_walk[0] if isinstance(o[0], str)]
    assert kinds.count("no") > 50 and kinds.count("ok") > 500  # both outcomes exercised
    assert flat_walk[3] > 50  # evictions
    if wired:
        assert any(entry[0] == "evict" for entry in flat_walk[2])


# -- state groups (linear attention, Mamba) -----------------------------------------------

def state(gid):
    return KVGroup(gid, AttentionKind.LINEAR, None, (gid,))


def test_state_group_without_prefix_caching_holds_one_block_per_request():
    mgr = KVCacheManager([full(0), state(1)], 32, BS, enable_prefix_caching=False)
    req = Req("a", range(10))
    res = mgr.allocate_slots(req, 10)
    assert [len(ids) for ids in res.new_block_ids] == [3, 1]
    for token in range(20):  # decoding never adds a state block
        req.all_token_ids.append(token)
        res = mgr.allocate_slots(req, 1)
        assert res.new_block_ids[1] == []
    assert len(mgr.get_block_ids("a")[1]) == 1
    assert mgr.usage().used == 8 + 1
    mgr.free(req)
    assert mgr.usage().used == 0 and mgr.usage().cached == 0


def test_state_checkpoints_at_block_boundaries_hold_at_most_two_blocks():
    mgr = KVCacheManager([full(0), state(1)], 32, BS)
    req = Req("a", range(10))
    # the prompt up to its last block boundary: the state after 8 tokens gets block 1
    res = mgr.allocate_slots(req, 8)
    s1 = res.new_block_ids[1][1]
    assert res.new_block_ids[1] == [NULL_BLOCK_ID, s1]
    assert mgr.pool.block_hash[s1] == hash_request_tokens(list(range(10)), BS)[1]
    res = mgr.allocate_slots(req, 2)  # the rest: a new block carries the state on
    s2 = res.new_block_ids[1][0]
    assert mgr.get_block_ids("a")[1] == [NULL_BLOCK_ID, s1, s2]
    req.all_token_ids.append(10)
    res = mgr.allocate_slots(req, 1)  # 10 computed: the checkpoint after 8 is released
    assert mgr.get_block_ids("a")[1] == [NULL_BLOCK_ID, NULL_BLOCK_ID, s2]
    assert res.num_null_blocks[1] == 2
    assert mgr.pool.free_queue.is_cached(s1)  # released, still findable
    for token in range(11, 30):
        req.all_token_ids.append(token)
        res = mgr.allocate_slots(req, 1)
        table = mgr.get_block_ids("a")[1]
        assert len([b for b in table if b]) <= 2 and table[-1] != NULL_BLOCK_ID
        assert all(b == NULL_BLOCK_ID for b in res.new_block_ids[1][:-1])


def test_hybrid_hit_ends_where_a_state_checkpoint_is_cached():
    mgr = KVCacheManager([full(0), state(1)], 64, BS)
    a = Req("a", range(21))
    # chunks ending on block boundaries leave checkpoints after 12 and 20 tokens, not 16
    assert mgr.allocate_slots(a, 12) and mgr.allocate_slots(a, 8) and mgr.allocate_slots(a, 1)
    mgr.new_step()
    mgr.free(a)
    b = Req("b", list(range(16)) + [99] * 8)  # shares 16 tokens with a
    hit = mgr.get_computed_blocks(b)
    # full attention has blocks for 16 tokens, the state only a checkpoint at 12
    assert hit.num_tokens == 12
    assert hit.blocks[1][:2] == [NULL_BLOCK_ID] * 2 and hit.blocks[1][2] != NULL_BLOCK_ID
    assert len(hit.blocks[0]) == 3 and NULL_BLOCK_ID not in hit.blocks[0]
    assert mgr.allocate_slots(b, b.num_tokens - 12, prefix_hit=hit)
    assert mgr.get_block_ids("b")[1][:3] == hit.blocks[1]
    c = Req("c", list(range(21)) + [5])  # a's whole prompt: the checkpoint after 20
    assert mgr.get_computed_blocks(c).num_tokens == 20


def test_a_checkpoint_computed_this_step_is_hit_from_the_next_step():
    mgr = KVCacheManager([full(0), state(1)], 64, BS)
    a = Req("a", range(9))
    assert mgr.allocate_slots(a, 8)  # computes the checkpoint after 8 tokens
    b = Req("b", list(range(8)) + [7, 7])
    hit = mgr.get_computed_blocks(b)
    assert hit.num_tokens == 8
    before = pool_snapshot(mgr.pool)
    res = mgr.allocate_slots(b, 2, prefix_hit=hit)
    assert isinstance(res, NoCapacity) and "this step" in res.reason
    assert pool_snapshot(mgr.pool) == before and not mgr.has_request("b")
    mgr.new_step()
    assert mgr.allocate_slots(b, 2, prefix_hit=hit)


def test_state_blocks_are_all_or_nothing_with_attention_blocks():
    mgr = KVCacheManager([full(0), state(1), state(2)], 6, BS, enable_prefix_caching=False)
    a = Req("a", range(12))  # 3 attention blocks + 2 state blocks = 5 = the whole pool
    assert mgr.allocate_slots(a, 12)
    b = Req("b", range(2))
    before = pool_snapshot(mgr.pool)
    res = mgr.allocate_slots(b, 2)
    assert isinstance(res, NoCapacity) and res.needed_blocks == 3 and res.can_ever_fit
    assert pool_snapshot(mgr.pool) == before
    assert not mgr.can_fit(13) and mgr.can_fit(12)
    too_long = Req("c", range(13))
    assert mgr.allocate_slots(too_long, 13).can_ever_fit is False


def test_can_fit_counts_the_state_blocks_a_request_holds_at_once():
    # with checkpoints a request holds its state and the block the next state goes to
    mgr = KVCacheManager([full(0), state(1)], 7, BS)
    assert mgr.can_fit(16) and not mgr.can_fit(17)  # 4 + 2 blocks, 5 + 2 blocks
    assert KVCacheManager([full(0), state(1)], 7, BS, enable_prefix_caching=False).can_fit(20)
    assert KVCacheManager([full(0), state(1)], 7, BS).can_fit(4)  # one block, one state


def test_fork_shares_no_state():
    mgr = KVCacheManager([full(0), state(1)], 32, BS, enable_prefix_caching=False)
    parent = Req("p", range(9))
    assert mgr.allocate_slots(parent, 9)
    assert isinstance(mgr.fork(parent, Req("c", range(9))), NoCapacity)


def test_vllm_032_republishes_the_prompt_checkpoint():
    """vLLM 0.32 counts a prompt's last checkpoint as computed again while its request's
    computed tokens end in the next block; a hit on it then waits a step."""
    for republish, refused in ((False, False), (True, True)):
        mgr = KVCacheManager([full(0), state(1)], 64, BS,
                             republish_prompt_checkpoint=republish)
        a = Req("a", range(10))
        a.num_prompt_tokens = 10
        assert mgr.allocate_slots(a, 8)
        mgr.new_step()
        assert mgr.allocate_slots(a, 2)  # computed tokens end in the block after 8
        b = Req("b", list(range(8)) + [3, 3])
        hit = mgr.get_computed_blocks(b)
        assert hit.num_tokens == 8
        assert isinstance(mgr.allocate_slots(b, 2, prefix_hit=hit), NoCapacity) == refused
