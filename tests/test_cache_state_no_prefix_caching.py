"""kvmem.cache with prefix caching off, under random operation sequences: a state group
(Mamba / linear attention) then holds one state block per request. After every step: each
block is free or held by exactly the block tables naming it, none is cached, and no state
block is shared by two running requests (they write their states in place)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from test_cache_state_machine import BS, Req, StateCacheMachine

from kvmem.cache import NULL_BLOCK_ID, KVCacheManager, NoCapacity
from kvmem.spec import AttentionKind


class NoPrefixCachingMachine(RuleBasedStateMachine):
    groups = StateCacheMachine.groups
    num_blocks = 24

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(self.groups, self.num_blocks, BS, max_num_batched_tokens=12,
                                  enable_prefix_caching=False)
        self.running: dict[str, Req] = {}
        self.computed: dict[str, int] = {}
        self.waiting: list[Req] = []
        self.next_id = 0

    def allocate(self, req: Req, num_new: int, lookahead: int = 0) -> bool:
        res = self.mgr.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
        if not res:
            assert isinstance(res, NoCapacity)
            return False
        rid = req.request_id
        self.computed[rid] = self.computed.get(rid, 0) + num_new
        self.running[rid] = req
        assert self.mgr.num_computed_tokens(rid) == self.computed[rid]
        return True

    def pick(self, index: int) -> Req | None:
        return self.running[sorted(self.running)[index % len(self.running)]] \
            if self.running else None

    def drop(self, req: Req) -> None:
        self.mgr.free(req)
        del self.running[req.request_id], self.computed[req.request_id]

    @rule(tokens=st.lists(st.integers(0, 30), min_size=1, max_size=20),
          chunk=st.integers(1, 12))
    def new_request(self, tokens, chunk):
        req = Req(f"r{self.next_id}", tokens, None)
        self.next_id += 1
        assert self.mgr.get_computed_blocks(req).num_tokens == 0  # nothing is cached
        if not self.allocate(req, min(chunk, len(tokens))):
            self.waiting.append(req)

    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12))
    def restart_waiting(self, index, chunk):
        if self.waiting:
            req = self.waiting.pop(index % len(self.waiting))
            if not self.allocate(req, min(chunk, req.num_tokens)):
                self.waiting.append(req)

    @rule(index=st.integers(0, 100), n=st.integers(1, 12), lookahead=st.integers(0, 3),
          token=st.integers(0, 30))
    def advance(self, index, n, lookahead, token):
        req = self.pick(index)
        if req is None:
            return
        done = self.computed[req.request_id]
        if done < req.num_tokens:
            self.allocate(req, min(n, req.num_tokens - done), lookahead)
            return
        req.all_token_ids.append(token)
        if not self.allocate(req, 1, lookahead):
            req.all_token_ids.pop()

    @rule(index=st.integers(0, 100), requeue=st.booleans())
    def finish_or_preempt(self, index, requeue):
        req = self.pick(index)
        if req is not None:
            self.drop(req)
            if requeue:
                self.waiting.append(req)

    @rule()
    def new_step(self):
        self.mgr.new_step()

    @invariant()
    def consistent(self):
        pool = self.mgr.pool
        refs = [0] * self.num_blocks
        state_owner: dict[int, str] = {}
        for rid in self.running:
            for table, group in zip(self.mgr.get_block_ids(rid), self.groups, strict=True):
                blocks = [b for b in table if b != NULL_BLOCK_ID]
                for b in blocks:
                    refs[b] += 1
                if group.kind is AttentionKind.LINEAR:
                    assert len(blocks) == 1 and table[-1] == blocks[0]  # one state block
                    assert state_owner.setdefault(blocks[0], rid) == rid
        assert refs[1:] == pool.ref_cnt[1:]  # no block double-owned or leaked
        free = pool.free_queue.free_ids()
        assert len(set(free)) == len(free) and not pool.free_queue.cached_ids()
        used = {b for b in range(1, self.num_blocks) if pool.ref_cnt[b]}
        assert set(free) | used == set(range(1, self.num_blocks)) and not set(free) & used
        assert all(h is None for h in pool.block_hash[1:])
        u = self.mgr.usage()
        assert (u.free, u.used, u.cached) == (len(free), len(used), 0)


def test_state_group_without_prefix_caching():
    run_state_machine_as_test(NoPrefixCachingMachine, settings=settings(
        max_examples=200, stateful_step_count=50, deadline=None))
