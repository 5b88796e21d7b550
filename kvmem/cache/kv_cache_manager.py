"""KVCacheManager: the engine's interface to KV blocks.

The scheduler asks it for a request's prefix hit, for slots (blocks) for the tokens it
schedules, and frees a request's blocks when it finishes or is preempted. Running out of
blocks is a normal outcome: ``allocate_slots`` returns ``NoCapacity`` and takes nothing
(it only releases the blocks that left the request's attention span, as vLLM does).

A request is any object with ``request_id: str``, ``all_token_ids`` (prompt + output so
far), ``num_tokens`` and optionally ``lora_name`` / ``cache_salt`` (extra hash keys) and
``block_hashes`` (a list the manager fills with the request's block hashes, so they are
computed once per request and survive preemption; it may also be filled in advance).

Blocks are cached (made findable by their hash) when ``allocate_slots`` schedules the
tokens that fill them, like vLLM does: the model runner must write a step's new KV before
attention reads it, so a request scheduled in the same step may already hit them. A state
group's checkpoint is different: a request starts from the state it hits, which exists
only after the step that computes it, so a hit on a checkpoint cached in the current step
is refused (``NoCapacity``) until the scheduler calls ``new_step``.

``republish_prompt_checkpoint=True`` reproduces vLLM 0.32, which also counts a request's
last prompt checkpoint (the state after ``(num_prompt_tokens - 1) // block_size`` blocks;
requests then need ``num_prompt_tokens``) as computed in every step whose computed tokens
end in the block after it; vLLM 0.33 and the default do not.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Protocol

from xxhash import xxh3_128_digest

from kvmem.cache.block_pool import BlockPool
from kvmem.cache.coordinator import LOAD_BLOCK, KVCacheCoordinator
from kvmem.cache.free_queue import FreeBlockQueue
from kvmem.cache.hashing import (
    ROOT_PARENT_HASH,
    BlockHash,
    block_packer,
    extend_block_hashes,
    request_extra_keys,
)
from kvmem.cache.managers import StateManager
from kvmem.cache.results import (
    NULL_BLOCK_ID,
    Allocation,
    CacheUsage,
    KVCacheEvent,
    NoCapacity,
    PrefixHit,
)
from kvmem.errors import ConfigError
from kvmem.spec.layout import KVGroup

# ``Allocation(...)`` goes through the NamedTuple's Python-level ``__new__``; the flat paths,
# run once per decode step, build the same tuple at C level
_new_allocation = partial(tuple.__new__, Allocation)


class CacheRequest(Protocol):
    request_id: str
    all_token_ids: Sequence[int]
    num_tokens: int


class _RequestState:
    """What the manager keeps per request: block tables, hashes, progress."""

    __slots__ = ("tables", "skipped", "num_computed", "num_cached", "hashes", "extra_keys")

    def __init__(self, num_groups: int, hashes: list[BlockHash], extra_keys: bytes) -> None:
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.skipped = [0] * num_groups  # leading entries already replaced by the null block
        self.num_cached = [0] * num_groups  # leading entries already offered to the cache
        self.num_computed = 0
        self.hashes = hashes
        self.extra_keys = extra_keys


class KVCacheManager:
    """Block tables, prefix caching and capacity checks for every request, over one pool."""

    def __init__(self, groups: list[KVGroup], num_blocks: int, block_size: int = 16, *,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 8192,
                 pool: BlockPool | None = None, enable_events: bool = True,
                 republish_prompt_checkpoint: bool = False) -> None:
        groups = list(groups)
        if not groups:
            raise ConfigError("the KV cache needs at least one KV group of attention layers")
        if [g.group_id for g in groups] != list(range(len(groups))):
            raise ConfigError("KV groups must be numbered 0, 1, ... in order")
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        if pool is None:
            if num_blocks < 2:
                raise ConfigError(f"the KV cache needs at least 2 blocks (block 0 is reserved), "
                                  f"got {num_blocks}")
            pool = BlockPool(num_blocks, len(groups), enable_events=enable_events)
        elif pool.num_blocks != num_blocks:
            raise ConfigError(f"pool has {pool.num_blocks} blocks, manager was given {num_blocks}")
        self.groups = groups
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool
        self.coordinator = KVCacheCoordinator(groups, pool, block_size,
                                              state_checkpoints=enable_prefix_caching)
        self._requests: dict[str, _RequestState] = {}
        # one group of per-token KV that never releases blocks early: allocations take a
        # flat path
        self._flat_decode = len(groups) == 1 and not self.coordinator.managers[0].releases_blocks \
            and not self.coordinator.state_managers
        # hashes of state checkpoints cached since the last new_step()
        self._state_cached_this_step: set[BlockHash] = set()
        self._state_groups = [m.holds_state for m in self.coordinator.managers]
        # the pool's own queue: a decode step may take its one block straight from it
        # (pop_n raises when it is empty)
        self._plain_queue = type(pool.free_queue) is FreeBlockQueue
        self._republish = republish_prompt_checkpoint and enable_prefix_caching \
            and bool(self.coordinator.state_managers)
        self._pack_block = block_packer(block_size)

    @classmethod
    def from_plan(cls, groups: list[KVGroup], plan: object, **kwargs) -> KVCacheManager:
        """Size the manager from a ``kvmem.plan`` result (``plan.engine.num_blocks`` and
        ``plan.engine.block_size``), so the engine and the planner cannot disagree."""
        engine = getattr(plan, "engine", plan)
        return cls(groups, engine.num_blocks, engine.block_size, **kwargs)

    # -- prefix hits -----------------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> PrefixHit:
        """The longest cached prefix of ``request`` valid for every group. Changes nothing."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching or max_blocks <= 0:
            return PrefixHit(0, tuple([] for _ in self.groups), [], self.pool.epoch)
        hashes = self.request_block_hashes(request, max_blocks)
        num_blocks, blocks = self.coordinator.find_longest_cache_hit(hashes, max_blocks)
        return PrefixHit(num_blocks * self.block_size, blocks, hashes, self.pool.epoch)

    def request_block_hashes(self, request: CacheRequest,
                             num_blocks: int | None = None) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks (default: all of them)."""
        if num_blocks is None:
            num_blocks = request.num_tokens // self.block_size
        state = self._requests.get(request.request_id)
        hashes = getattr(request, "block_hashes", None)
        if hashes is None:
            hashes = state.hashes if state is not None else []
        if len(hashes) < num_blocks:
            extra = state.extra_keys if state is not None else request_extra_keys(request)
            extend_block_hashes(hashes, request.all_token_ids, num_blocks, self.block_size,
                                extra)
        return hashes

    def lookup_hash(self, group_id: int, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash`` in ``group_id``'s cache, or None."""
        return self.pool.get_cached_block(group_id, block_hash)

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int, *,
                       prefix_hit: PrefixHit | None = None,
                       num_lookahead_tokens: int = 0) -> Allocation | NoCapacity:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens (plus lookahead slots).

        On the first call, ``prefix_hit`` (from ``get_computed_blocks``) is adopted: its
        tokens count as computed. Its ``LOAD_BLOCK`` entries (blocks an offload tier holds)
        get new blocks; such a hit schedules no new tokens, and its blocks become findable
        by hash only when later tokens are scheduled (after the caller has loaded them).
        All-or-nothing across groups; ``NoCapacity`` when the blocks are not there, with
        nothing taken (blocks that left a window or an old state are released either way).
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("num_new_tokens and num_lookahead_tokens must be >= 0")
        state = self._requests.get(request.request_id)
        if state is not None and prefix_hit is None and self._flat_decode:
            return self._extend_single_full(state, request, num_new_tokens, num_lookahead_tokens)
        hit = None
        loading = prefix_hit is not None and any(LOAD_BLOCK in b for b in prefix_hit.blocks)
        if loading and num_new_tokens:
            raise ValueError("a prefix hit with blocks still to load schedules no new tokens")
        if state is None and self._flat_decode and not loading:
            return self._start_single_full(request, num_new_tokens, num_lookahead_tokens,
                                           prefix_hit)
        if state is None:
            num_computed = 0
            if prefix_hit is not None and prefix_hit.num_tokens:
                if not self._hit_is_current(prefix_hit):
                    return NoCapacity("prefix hit is stale (its blocks were evicted); "
                                      "look it up again")
                if self._state_cached_this_step and self._hits_new_state(prefix_hit):
                    return NoCapacity("the hit's state checkpoint is computed in this step; "
                                      "it can be read from the next one")
                num_computed = prefix_hit.num_tokens
                hit = prefix_hit.blocks
            tables: list[list[int]] = [[] for _ in self.groups]
            skipped = [0] * len(self.groups)
        else:
            if prefix_hit is not None and prefix_hit.num_tokens:
                raise ValueError(f"request {request.request_id!r} already has blocks; a prefix "
                                 "hit applies only to its first allocation")
            num_computed = state.num_computed
            tables, skipped = state.tables, state.skipped

        result = self.coordinator.allocate(
            tables, skipped, num_computed, num_computed + num_new_tokens + num_lookahead_tokens,
            hit, num_lookahead_tokens)
        if isinstance(result, NoCapacity):
            return result

        if state is None:
            hashes = getattr(request, "block_hashes", None)
            if hashes is None:
                hashes = prefix_hit.block_hashes if prefix_hit is not None else []
            state = _RequestState(len(self.groups), hashes, request_extra_keys(request))
            state.tables, state.skipped = tables, skipped
            if hit:
                state.num_cached = [blocks.index(LOAD_BLOCK) if LOAD_BLOCK in blocks
                                    else len(blocks) for blocks in hit]
            self._requests[request.request_id] = state
        state.num_computed = num_computed = num_computed + num_new_tokens
        if self.enable_prefix_caching and not loading and \
                num_computed // self.block_size > min(state.num_cached):
            self._cache_full_blocks(state, request, min(num_computed, request.num_tokens))
        if self._republish and not loading:
            self._republish_checkpoint(state, request)
        return Allocation(result, num_computed - num_new_tokens, tuple(state.skipped))

    def fork(self, parent: CacheRequest, child: CacheRequest) -> Allocation | NoCapacity:
        """Give ``child`` (same prompt, no blocks yet) references to ``parent``'s full prompt
        blocks, all but the one holding the last prompt token, which the child recomputes
        to sample from. The blocks are shared, not copied. ``NoCapacity`` (nothing changed)
        when the parent has no such block, a group releases blocks early (a sliding
        window may already have dropped blocks the child's recompute attends to), or a
        group keeps a recurrent state (one per request, never shared while running)."""
        state = self._requests.get(parent.request_id)
        num_blocks = (child.num_tokens - 1) // self.block_size
        if state is None or num_blocks <= 0 or self.coordinator._releasing or \
                self.coordinator.state_managers or \
                state.num_computed < num_blocks * self.block_size:
            return NoCapacity("nothing to share: the child computes its prompt itself")
        hit = PrefixHit(num_blocks * self.block_size,
                        tuple(list(table[:num_blocks]) for table in state.tables),
                        list(state.hashes[:num_blocks]), self.pool.epoch)
        return self.allocate_slots(child, 0, prefix_hit=hit)

    def _start_single_full(self, request: CacheRequest, num_new_tokens: int,
                           num_lookahead_tokens: int, prefix_hit: PrefixHit | None
                           ) -> Allocation | NoCapacity:
        """A request's first ``allocate_slots`` for a model with one full-attention group
        (its prompt): the general path's outcome without the coordinator's per-group lists."""
        hit: list[int] = []
        num_computed = 0
        if prefix_hit is not None and prefix_hit.num_tokens:
            if not self._hit_is_current(prefix_hit):
                return NoCapacity("prefix hit is stale (its blocks were evicted); "
                                  "look it up again")
            hit = prefix_hit.blocks[0]
            num_computed = prefix_hit.num_tokens
        pool = self.pool
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens)
                         // self.block_size)
        need = num_required - len(hit) if num_required > len(hit) else 0
        taken = need
        ref_cnt, hold_cnt = pool.ref_cnt, pool.hold_cnt
        for block_id in hit:
            if block_id > 0 and ref_cnt[block_id] == 0 and not hold_cnt[block_id]:
                taken += 1  # a cached-free block leaves the free queue
        guard = pool.capacity_guard
        if taken > len(pool.free_queue) or (taken and guard is not None and not guard(taken)):
            return self.coordinator.no_capacity(taken, 0, num_computed, num_required,
                                                [len(hit)], [[]])
        if hit:
            pool.touch(hit)
        new_ids = pool.take_new_blocks(need, 0)
        hashes = getattr(request, "block_hashes", None)
        if hashes is None:
            hashes = prefix_hit.block_hashes if prefix_hit is not None else []
        state = _RequestState(1, hashes, request_extra_keys(request))
        state.tables[0] = hit + new_ids
        state.num_cached[0] = len(hit)
        self._requests[request.request_id] = state
        state.num_computed = num_tokens = num_computed + num_new_tokens
        if self.enable_prefix_caching and num_tokens // self.block_size > len(hit):
            if pool.events is None:  # the new blocks are cached without per-block checks
                self._cache_new_prompt_blocks(state, request, new_ids, len(hit))
            else:
                self._cache_full_blocks(state, request, min(num_tokens, request.num_tokens))
        return _new_allocation(((new_ids,), num_computed, (0,)))

    def _cache_new_prompt_blocks(self, state: _RequestState, request: CacheRequest,
                                 new_ids: list[int], num_hit: int) -> None:
        """``_cache_full_blocks`` after a first allocation that took ``new_ids`` after a
        hit of ``num_hit`` blocks: the full blocks among them are new, so none is the null
        block or already has a hash."""
        num_full = min(state.num_computed, request.num_tokens) // self.block_size
        hashes = state.hashes
        if len(hashes) < num_full:
            extend_block_hashes(hashes, request.all_token_ids, num_full, self.block_size,
                                state.extra_keys)
        end = min(num_full, num_hit + len(new_ids))
        if end > num_hit:
            self.pool.cache_new_blocks(0, new_ids, hashes[num_hit:end])
            state.num_cached[0] = end

    def _extend_single_full(self, state: _RequestState, request: CacheRequest,
                            num_new_tokens: int, num_lookahead_tokens: int
                            ) -> Allocation | NoCapacity:
        """``allocate_slots`` for a running request of a model with one full-attention group
        (each decode step): the general path's outcome, without its per-group bookkeeping.

        A step that fills exactly one block (the usual decode step) hashes and caches it
        inline; several blocks go through ``extend_block_hashes`` and the pool.
        """
        block_size = self.block_size
        num_computed = state.num_computed
        table = state.tables[0]
        num_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        need = (num_tokens + block_size - 1) // block_size - len(table)
        pool = self.pool
        if need == 1 and self._plain_queue and pool.capacity_guard is None \
                and not pool.listeners:  # the usual decode step: one block, inlined
            try:
                new_ids = pool.free_queue.pop_n(1)
            except ValueError:
                return self.coordinator.no_capacity(1, 0, num_computed, len(table) + 1, [0],
                                                    state.tables)
            block_id = new_ids[0]
            old_hash = pool.block_hash[block_id]
            if old_hash is None:
                pool.ref_cnt[block_id] = 1
            elif pool.events is None and pool.evict_listener is None \
                    and old_hash not in pool.copies[0]:  # evict its cached data, inlined
                del pool.cached[0][old_hash]
                pool.block_hash[block_id] = None
                pool.epoch += 1
                pool.ref_cnt[block_id] = 1
            else:
                pool._claim(new_ids, 0)  # evicts its cached data
            pool.block_group[block_id] = 0
            table.append(block_id)
        elif need > 0:
            guard = pool.capacity_guard
            if need > len(pool.free_queue) or (guard is not None and not guard(need)):
                return self.coordinator.no_capacity(need, 0, num_computed, len(table) + need,
                                                    [0], state.tables)
            new_ids = pool.take_new_blocks(need, 0)
            table += new_ids
        else:
            new_ids = []
        state.num_computed = num_tokens = num_computed + num_new_tokens
        if self.enable_prefix_caching:
            if num_tokens > request.num_tokens:
                num_tokens = request.num_tokens
            num_full = num_tokens // block_size
            num_cached = state.num_cached
            start = num_cached[0]
            if num_full > start:
                hashes = state.hashes
                end = num_full if num_full < len(table) else len(table)
                if end == start + 1 and len(hashes) >= start:
                    self._cache_one_block(table[start], start, hashes, request.all_token_ids,
                                          state.extra_keys)
                else:
                    if len(hashes) < num_full:
                        extend_block_hashes(hashes, request.all_token_ids, num_full,
                                            block_size, state.extra_keys)
                    self.pool.cache_table_blocks(0, table, hashes, start, end)
                num_cached[0] = end
        return _new_allocation(((new_ids,), num_computed, ()))

    def _cache_one_block(self, block_id: int, index: int, hashes: list[BlockHash],
                         token_ids: Sequence[int], extra_keys: bytes) -> None:
        """``extend_block_hashes`` and ``cache_table_blocks`` for the request's block
        ``index`` alone (group 0), whose parent's hash is known."""
        if len(hashes) == index:
            first = index * self.block_size
            try:
                packed = self._pack_block(*token_ids[first:first + self.block_size])
            except struct.error:
                raise ValueError("token ids must be integers in [0, 2**32)") from None
            hashes.append(xxh3_128_digest((hashes[-1] if index else ROOT_PARENT_HASH)
                                          + packed + extra_keys))
        pool = self.pool
        if block_id == NULL_BLOCK_ID or pool.block_hash[block_id] is not None:
            return
        block_hash = hashes[index]
        group_map = pool.cached[0]
        if block_hash in group_map:  # same content already cached in another block
            pool.add_copy(0, block_id, block_hash)
            return
        group_map[block_hash] = block_id
        pool.block_hash[block_id] = block_hash
        events = pool.events
        if events is not None:
            events.append(KVCacheEvent("stored", block_hash, block_id, 0,
                                       hashes[index - 1] if index else None))
            if len(events) > pool.max_events:
                pool._bound_events()

    def _hit_is_current(self, hit: PrefixHit) -> bool:
        """Whether every block of ``hit`` still holds the hash it was found by."""
        pool = self.pool
        if hit.epoch == pool.epoch:
            return True  # no hash was dropped since the lookup
        block_hash, block_group = pool.block_hash, pool.block_group
        for g, blocks in enumerate(hit.blocks):
            for i, block_id in enumerate(blocks):
                if block_id > NULL_BLOCK_ID and (block_hash[block_id] != hit.block_hashes[i]
                                                  or block_group[block_id] != g):
                    return False
        return True

    def _hits_new_state(self, hit: PrefixHit) -> bool:
        """Whether a state group's block of ``hit`` was cached in the current step."""
        for manager in self.coordinator.state_managers:
            blocks = hit.blocks[manager.group_index]
            if blocks and hit.block_hashes[len(blocks) - 1] in self._state_cached_this_step:
                return True
        return False

    def _republish_checkpoint(self, state: _RequestState, request: CacheRequest) -> None:
        """vLLM 0.32: the prompt's last checkpoint counts as computed in this step while the
        request's computed tokens end in the block after it."""
        bs = self.block_size
        boundary = (request.num_prompt_tokens - 1) // bs * bs  # type: ignore[attr-defined]
        if boundary <= 0 or min(state.num_computed, request.num_tokens) // bs * bs != boundary:
            return
        index = boundary // bs - 1
        for manager in self.coordinator.state_managers:
            table = state.tables[manager.group_index]
            if index < len(table) and table[index] != NULL_BLOCK_ID:
                self._state_cached_this_step.add(state.hashes[index])

    def new_step(self) -> None:
        """A scheduler step begins: state checkpoints cached so far can be hit."""
        self._state_cached_this_step.clear()

    def cache_blocks(self, request: CacheRequest, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to ``num_computed_tokens`` findable by hash."""
        state = self._requests.get(request.request_id)
        if state is not None and self.enable_prefix_caching:
            self._cache_full_blocks(state, request, num_computed_tokens)

    def _cache_full_blocks(self, state: _RequestState, request: CacheRequest,
                           num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        hashes = state.hashes
        if len(hashes) < num_full:
            extend_block_hashes(hashes, request.all_token_ids, num_full, self.block_size,
                                state.extra_keys)
        cache_table_blocks = self.pool.cache_table_blocks
        num_cached = state.num_cached
        for g, table in enumerate(state.tables):
            start = num_cached[g]
            end = num_full if num_full < len(table) else len(table)
            if end > start:
                cache_table_blocks(g, table, hashes, start, end)
                num_cached[g] = end
                if self._state_groups[g]:
                    for i in range(start, end):
                        if table[i]:
                            self._state_cached_this_step.add(hashes[i])

    def free(self, request: CacheRequest | str) -> None:
        """Release a finished or preempted request's blocks, tail first (evicted first)."""
        request_id = request if isinstance(request, str) else request.request_id
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        # group by group, as vLLM frees them
        self.pool.free_runs([reversed(table) for table in state.tables])

    # -- views -----------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block table per group (live lists: read them, do not modify them)."""
        state = self._requests.get(request_id)
        if state is None:
            return tuple([] for _ in self.groups)
        return tuple(state.tables)

    def num_computed_tokens(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return state.num_computed if state is not None else 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def usage(self) -> CacheUsage:
        return self.pool.usage()

    def can_fit(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in the otherwise empty pool."""
        need = 0
        for group, manager in zip(self.groups, self.coordinator.managers, strict=True):
            if isinstance(manager, StateManager):  # the state, and the next one under way
                need += 2 if manager.checkpoints and num_tokens > self.block_size else 1
            else:
                need += group.blocks_per_request(num_tokens, self.block_size,
                                                 self.max_num_batched_tokens)
        return need <= self.pool.num_usable

    # -- transfers, events, reset ----------------------------------------------------------

    def hold(self, block_ids: Iterable[int]) -> None:
        """Keep blocks neither free nor evictable until ``release`` (in-flight transfers)."""
        self.pool.hold(block_ids)

    def release(self, block_ids: Iterable[int]) -> None:
        self.pool.release(block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        """Stored / evicted / removed events since the last call."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use or held."""
        return self.pool.reset_prefix_cache()
