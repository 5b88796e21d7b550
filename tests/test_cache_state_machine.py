"""kvmem.cache under random operation sequences: allocate / append / free / preempt / hold /
release / cache / lookup / reset / new step on a small hybrid pool, on one with a recurrent
state group (linear attention / Mamba checkpoints) and on a single full-attention pool
(whose running requests take the manager's flat decode path), with every invariant checked
after every step (from first principles, not from the pool's own counters)."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvmem.cache import NULL_BLOCK_ID, KVCacheManager, NoCapacity, hash_request_tokens
from kvmem.cache.hashing import encode_extra_keys
from kvmem.spec import AttentionKind, KVGroup

BS = 4
HYBRID_GROUPS = [KVGroup(0, AttentionKind.FULL, None, (0,)),
                 KVGroup(1, AttentionKind.SLIDING, 9, (1,)),
                 KVGroup(2, AttentionKind.CHUNKED, 16, (2,))]
PREFIXES = [[7] * 12, list(range(20)), list(range(5, 21))]
STEPS = {"count": 0}


def first_needed(group: KVGroup, num_tokens: int) -> int:
    """First block the token at ``num_tokens`` attends to (the rules, written out again); for
    a state group, the block holding the state after ``num_tokens`` tokens."""
    if group.kind is AttentionKind.LINEAR:
        return max(0, num_tokens - 1) // BS
    if group.kind is AttentionKind.SLIDING:
        return max(0, num_tokens - (group.window - 1)) // BS
    if group.kind is AttentionKind.CHUNKED:
        return num_tokens // group.window * group.window // BS
    return 0


class Req:
    def __init__(self, request_id: str, token_ids: list[int], cache_salt: str | None) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.cache_salt = cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def true_hashes(self) -> list[bytes]:
        return hash_request_tokens(self.all_token_ids, BS, encode_extra_keys(
            cache_salt=self.cache_salt))


class CacheMachine(RuleBasedStateMachine):
    groups = HYBRID_GROUPS
    num_blocks = 40

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(self.groups, self.num_blocks, BS, max_num_batched_tokens=12)
        self.pool = self.mgr.pool
        self.running: dict[str, Req] = {}
        self.computed: dict[str, int] = {}  # tokens computed (the engine's view)
        self.released_upto: dict[str, int] = {}  # computed count at the last allocation
        self.waiting: list[Req] = []
        self.holds: list[list[int]] = []
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------

    def snapshot(self):
        pool, q = self.pool, self.pool.free_queue
        tables = {rid: [list(t) for t in self.mgr.get_block_ids(rid)] for rid in self.running}
        return (list(pool.ref_cnt), list(pool.hold_cnt), list(pool.block_hash),
                list(pool.block_group), q.free_ids(), q.cached_ids(), sorted(pool.held_idle),
                [dict(m) for m in pool.cached], tables,
                {rid: self.mgr.num_computed_tokens(rid) for rid in self.running})

    def allocate(self, req: Req, num_new: int, lookahead: int = 0, hit=None) -> bool:
        before = self.snapshot()
        prev_lengths = [len(t) for t in self.mgr.get_block_ids(req.request_id)]
        res = self.mgr.allocate_slots(req, num_new, prefix_hit=hit,
                                      num_lookahead_tokens=lookahead)
        if not res:
            assert isinstance(res, NoCapacity)
            after = self.snapshot()
            if after != before:  # only blocks that left the span were released
                rid = req.request_id
                assert rid in self.running and after[9] == before[9]
                for g, group in enumerate(self.groups):
                    lo = min(first_needed(group, self.computed[rid]), len(before[8][rid][g]))
                    expected = [NULL_BLOCK_ID] * lo + before[8][rid][g][lo:]
                    assert after[8][rid][g] == expected
                self.released_upto[rid] = self.computed[rid]
                assert [len(t) for t in after[8][rid]] == prev_lengths
            return False
        rid = req.request_id
        start = self.computed.get(rid, hit.num_tokens if hit else 0)
        self.released_upto[rid] = start
        self.computed[rid] = start + num_new
        self.running[rid] = req
        assert self.mgr.num_computed_tokens(rid) == self.computed[rid]
        need = -(-(start + num_new + lookahead) // BS)
        state_need = -(-(start + num_new) // BS)  # a state takes no lookahead slots
        tables = self.mgr.get_block_ids(rid)
        old_tables = before[8].get(rid) or (hit.blocks if hit else [[] for _ in self.groups])
        for g, group in enumerate(self.groups):
            state = group.kind is AttentionKind.LINEAR
            assert len(tables[g]) == max(len(old_tables[g]), state_need if state else need)
            expected = list(old_tables[g])
            lo = min(first_needed(group, start), len(expected))  # out of the span: null
            expected[:lo] = [NULL_BLOCK_ID] * lo
            assert tables[g] == expected + res.new_block_ids[g]
            if state:  # null entries, then at most one new state block at the end
                new = res.new_block_ids[g]
                assert all(b == NULL_BLOCK_ID for b in new[:-1])
                assert not new or new[-1] != NULL_BLOCK_ID
        return True

    def check_hit(self, req: Req, hit) -> None:
        hashes = req.true_hashes()
        assert hit.num_tokens % BS == 0 and hit.num_tokens < req.num_tokens
        n = hit.num_tokens // BS
        for g, (blocks, group) in enumerate(zip(hit.blocks, self.groups, strict=True)):
            assert len(blocks) == n
            lo = first_needed(group, hit.num_tokens)
            assert blocks[:lo] == [NULL_BLOCK_ID] * lo
            for i in range(lo, n):
                assert blocks[i] != NULL_BLOCK_ID
                assert self.pool.block_hash[blocks[i]] == hashes[i]
                assert self.pool.block_group[blocks[i]] == g

    def start(self, req: Req, chunk: int) -> None:
        before = self.snapshot()
        hit = self.mgr.get_computed_blocks(req)
        assert self.snapshot() == before, "a lookup must change nothing"
        self.check_hit(req, hit)
        num_new = min(chunk, req.num_tokens - hit.num_tokens)
        if not self.allocate(req, num_new, hit=hit):
            self.waiting.append(req)

    def pick(self, index: int) -> Req | None:
        if not self.running:
            return None
        return self.running[sorted(self.running)[index % len(self.running)]]

    def drop(self, req: Req) -> None:
        self.mgr.free(req)
        del self.running[req.request_id]
        del self.computed[req.request_id]

    # -- rules -----------------------------------------------------------------------------

    @rule(prefix=st.integers(0, len(PREFIXES)), suffix=st.lists(st.integers(0, 30), max_size=14),
          chunk=st.integers(1, 24), salt=st.sampled_from([None, None, "t"]))
    def new_request(self, prefix, suffix, chunk, salt):
        STEPS["count"] += 1
        tokens = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not tokens:
            tokens = [1]
        self.next_id += 1
        self.start(Req(f"r{self.next_id}", list(tokens), salt), chunk)

    @rule(index=st.integers(0, 100), chunk=st.integers(1, 24),
          other=st.lists(st.integers(0, 30), min_size=1, max_size=24))
    def start_with_old_hit(self, index, chunk, other):
        """Look a waiting request up, let another request allocate (it may evict the hit's
        blocks), then allocate with the old hit: it is used only if still valid."""
        STEPS["count"] += 1
        if not self.waiting:
            return
        req = self.waiting.pop(index % len(self.waiting))
        hit = self.mgr.get_computed_blocks(req)
        self.next_id += 1
        self.start(Req(f"r{self.next_id}", other, None), chunk)
        if not self.allocate(req, min(chunk, req.num_tokens - hit.num_tokens), hit=hit):
            self.waiting.append(req)

    @rule(index=st.integers(0, 100), chunk=st.integers(1, 24))
    def restart_waiting(self, index, chunk):
        STEPS["count"] += 1
        if self.waiting:
            self.start(self.waiting.pop(index % len(self.waiting)), chunk)

    @rule(index=st.integers(0, 100), n=st.integers(1, 12), lookahead=st.integers(0, 3),
          token=st.integers(0, 30))
    def advance(self, index, n, lookahead, token):
        STEPS["count"] += 1
        req = self.pick(index)
        if req is None:
            return
        done = self.computed[req.request_id]
        if done < req.num_tokens:  # chunked prefill
            self.allocate(req, min(n, req.num_tokens - done), lookahead)
            return
        req.all_token_ids.append(token)  # decode one token
        if not self.allocate(req, 1, lookahead):
            req.all_token_ids.pop()

    @rule(index=st.integers(0, 100))
    def finish(self, index):
        STEPS["count"] += 1
        req = self.pick(index)
        if req is not None:
            self.drop(req)

    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        STEPS["count"] += 1
        req = self.pick(index)
        if req is not None:
            self.drop(req)
            self.waiting.append(req)

    @rule(index=st.integers(0, 100), stride=st.integers(1, 3), cached_free=st.booleans())
    def hold(self, index, stride, cached_free):
        STEPS["count"] += 1
        if cached_free:
            ids = self.pool.free_queue.cached_ids()[::stride]
        else:
            req = self.pick(index)
            if req is None:
                return
            ids = [b for t in self.mgr.get_block_ids(req.request_id) for b in t if b][::stride]
        if ids:
            self.mgr.hold(ids)
            self.holds.append(ids)

    @rule(index=st.integers(0, 100))
    def release(self, index):
        STEPS["count"] += 1
        if self.holds:
            self.mgr.release(self.holds.pop(index % len(self.holds)))

    @rule(index=st.integers(0, 100))
    def cache(self, index):
        STEPS["count"] += 1
        req = self.pick(index)
        if req is not None:
            self.mgr.cache_blocks(req, self.computed[req.request_id])

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix=st.lists(st.integers(0, 30),
                                                                     max_size=10))
    def lookup(self, prefix, suffix):
        STEPS["count"] += 1
        req = Req("probe", PREFIXES[prefix] + suffix, None)
        before = self.snapshot()
        hit = self.mgr.get_computed_blocks(req)
        assert self.snapshot() == before
        self.check_hit(req, hit)

    @rule()
    def new_step(self):
        STEPS["count"] += 1
        self.mgr.new_step()

    @rule()
    def reset(self):
        STEPS["count"] += 1
        busy = self.mgr.usage().used or self.mgr.usage().held
        assert self.mgr.reset_prefix_cache() == (not busy)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        pool, q = self.pool, self.pool.free_queue
        everything = set(range(1, self.num_blocks))
        free, cached = q.free_ids(), q.cached_ids()
        used = {b for b in everything if pool.ref_cnt[b] > 0}
        held = set(pool.held_idle)
        states = [set(free), set(cached), used, held]
        assert len(free) == len(states[0]) and len(cached) == len(states[1])  # no duplicates
        assert sum(len(s) for s in states) == len(everything)  # no block in two states
        assert set().union(*states) == everything
        u = self.mgr.usage()
        assert (u.free, u.cached, u.used, u.held) == tuple(len(s) for s in states)
        assert u.free + u.cached + u.used + u.held == u.total == self.num_blocks - 1
        assert pool.ref_cnt[NULL_BLOCK_ID] == 0 and pool.hold_cnt[NULL_BLOCK_ID] == 0

        # ref count = number of block tables holding the block; holds = outstanding holds
        refs = [0] * self.num_blocks
        for rid, req in self.running.items():
            hashes = req.true_hashes()
            tables = self.mgr.get_block_ids(rid)
            for g, (table, group) in enumerate(zip(tables, self.groups, strict=True)):
                assert len(table) >= -(-self.computed[rid] // BS)
                lo = first_needed(group, self.released_upto[rid])
                assert table[:lo] == [NULL_BLOCK_ID] * lo
                if group.kind is AttentionKind.LINEAR:  # the running state, maybe a new one
                    assert table[-1] != NULL_BLOCK_ID
                    assert len([b for b in table if b]) <= 2
                else:
                    assert NULL_BLOCK_ID not in table[lo:]
                for i, b in enumerate(table):
                    if b == NULL_BLOCK_ID:
                        continue
                    refs[b] += 1
                    assert pool.block_group[b] == g
                    if pool.block_hash[b] is not None:  # cached content is the right content
                        assert i < len(hashes) and pool.block_hash[b] == hashes[i]
        assert refs[1:] == pool.ref_cnt[1:]
        holds = [0] * self.num_blocks
        for ids in self.holds:
            for b in ids:
                holds[b] += 1
        assert holds == pool.hold_cnt
        assert held == {b for b in everything if pool.ref_cnt[b] == 0 and pool.hold_cnt[b]}
        assert all(pool.block_hash[b] is None for b in free)
        assert all(pool.block_hash[b] is not None for b in cached)

        # every cached hash maps to a block with that hash, so do its later copies, and every
        # hashed block is one of them
        mapped = 0
        for g, (group_map, copies) in enumerate(zip(pool.cached, pool.copies, strict=True)):
            for h, b in group_map.items():
                assert pool.block_hash[b] == h and pool.block_group[b] == g
                mapped += 1
            for h, later in copies.items():
                assert h in group_map and later
                for b in later:
                    assert pool.block_hash[b] == h and pool.block_group[b] == g
                mapped += len(later)
        assert mapped == sum(1 for b in everything if pool.block_hash[b] is not None)


class StateCacheMachine(CacheMachine):
    """Full attention, a recurrent state with checkpoints at block boundaries, a window."""

    groups = [KVGroup(0, AttentionKind.FULL, None, (0,)),
              KVGroup(1, AttentionKind.LINEAR, None, (1,)),
              KVGroup(2, AttentionKind.SLIDING, 9, (2,))]
    num_blocks = 32


class FullAttentionCacheMachine(CacheMachine):
    """One full-attention group, fewer blocks: running out is frequent."""

    groups = [KVGroup(0, AttentionKind.FULL, None, (0,))]
    num_blocks = 16


def test_state_machine_hypothesis():
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None))


def test_state_machine_hypothesis_state_group():
    run_state_machine_as_test(StateCacheMachine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None))


def test_state_machine_hypothesis_single_full_attention_group():
    run_state_machine_as_test(FullAttentionCacheMachine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None))


def random_walk(machine_type: type[CacheMachine], num_steps: int, seed: int) -> int:
    """A seeded walk over the machine's rules with the invariants checked after every step;
    returns the number of steps taken."""
    rng = random.Random(seed)
    start = STEPS["count"]
    while STEPS["count"] - start < num_steps:
        machine = machine_type()
        for _ in range(400):
            action = rng.random()
            idx = rng.randrange(100)
            if action < 0.2:
                machine.new_request(rng.randrange(len(PREFIXES) + 1),
                                    [rng.randrange(31) for _ in range(rng.randrange(15))],
                                    rng.randint(1, 24), rng.choice([None, None, "t"]))
            elif action < 0.5:
                machine.advance(idx, rng.randint(1, 12), rng.randint(0, 3), rng.randrange(31))
            elif action < 0.54:
                machine.restart_waiting(idx, rng.randint(1, 24))
            elif action < 0.58:
                machine.start_with_old_hit(idx, rng.randint(1, 24),
                                           [rng.randrange(31) for _ in range(rng.randint(1, 24))])
            elif action < 0.66:
                machine.finish(idx)
            elif action < 0.72:
                machine.preempt(idx)
            elif action < 0.8:
                machine.hold(idx, rng.randint(1, 3), rng.random() < 0.5)
            elif action < 0.88:
                machine.release(idx)
            elif action < 0.93:
                machine.cache(idx)
            elif action < 0.95:
                machine.new_step()
            elif action < 0.995:
                machine.lookup(rng.randrange(len(PREFIXES)),
                               [rng.randrange(31) for _ in range(rng.randrange(11))])
            else:
                machine.reset()
            machine.consistent()
    return STEPS["count"] - start


def test_long_random_walk_runs_at_least_10000_steps():
    """Together with the hypothesis runs above well over 10,000 checked steps."""
    assert random_walk(CacheMachine, 12_000, seed=1234) >= 12_000


def test_long_random_walk_state_group():
    assert random_walk(StateCacheMachine, 6_000, seed=7) >= 6_000


def test_long_random_walk_single_full_attention_group():
    assert random_walk(FullAttentionCacheMachine, 6_000, seed=99) >= 6_000
