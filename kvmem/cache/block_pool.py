"""BlockPool: the state of every KV block id, shared by all KV groups.

Block ids are global across groups; block 0 is the null block and is never handed out.
Every other block is in exactly one state:

- **free**: ref count 0, no cached data, in the free queue (reused first);
- **cached** (cached-free): ref count 0, has a hash, in the free queue's LRU (evictable);
- **used**: ref count > 0 (the number of block tables holding it);
- **held**: ref count 0 but held by an in-flight transfer: neither free nor evictable.

A hold on a used block only takes effect when its ref count falls to 0. A block whose
content another block already caches (two requests computed the same prefix) keeps the
hash too, as in vLLM: lookups find the first such block, and the next takes its place when
it is evicted (``copies``). The pool size
comes from the planner (``kvmem.plan``: ``plan.engine.num_blocks``); the pool never
computes it.

Hooks for other packages (constructor arguments, except the evict listener):

- ``free_queue``: any object with ``FreeBlockQueue``'s methods (e.g. page-aware);
- ``listeners``: ``obj.on_blocks_allocated(ids)`` when blocks leave the free or
  cached-free state to be used, ``obj.on_blocks_released(ids)`` when blocks become free
  with no cached data;
- ``capacity_guard(n) -> bool``: whether ``n`` more blocks may be taken (an external
  memory limit); a False answer makes the allocation return ``NoCapacity``;
- ``evict_listener(evicted)``: called just before cached-free blocks are evicted (for
  reuse, or to give their memory back), with ``(block_id, group_id, block_hash)`` of each,
  once per take or eviction, so their content can be copied out first (set by the
  offload connector, which is built over the pool's manager).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from kvmem.cache.free_queue import FreeBlockQueue
from kvmem.cache.hashing import BlockHash
from kvmem.cache.results import NULL_BLOCK_ID, CacheUsage, KVCacheEvent

Evicted = tuple[int, int, BlockHash]  # a cached-free block evicted: (block id, group, hash)


class PoolListener(Protocol):
    def on_blocks_allocated(self, block_ids: list[int]) -> None: ...

    def on_blocks_released(self, block_ids: list[int]) -> None: ...


class BlockPool:
    """Ref counts, holds, the free queue and the prefix-cache map over ``num_blocks`` ids."""

    def __init__(self, num_blocks: int, num_groups: int = 1, *, enable_events: bool = True,
                 free_queue: FreeBlockQueue | None = None, max_events: int = 65_536,
                 capacity_guard: Callable[[int], bool] | None = None,
                 listeners: Iterable[PoolListener] = ()) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_usable = num_blocks - 1
        self.ref_cnt: list[int] = [0] * num_blocks
        self.hold_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # a one-group pool never changes a block's group: its plain paths skip the store
        self.block_group: list[int] = [0] * num_blocks
        # (group_id, hash) -> block id, as one dict per group
        self.cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        # (group_id, hash) -> later blocks with that hash, first cached first
        self.copies: list[dict[BlockHash, list[int]]] = [{} for _ in range(num_groups)]
        self.free_queue = free_queue if free_queue is not None else FreeBlockQueue(
            range(1, num_blocks))
        self.held_idle: set[int] = set()  # ref count 0 and held
        self.num_holds = 0  # sum of hold_cnt: lets frees skip the hold check when 0
        self.listeners: list[PoolListener] = list(listeners)
        self.capacity_guard = capacity_guard
        # set by the offload connector, which needs the pool first (it holds the pool's
        # blocks during copies, and the pool tells it of evictions)
        self.evict_listener: Callable[[list[Evicted]], None] | None = None
        # Events wait for take_events(); if nobody takes them, the oldest half is dropped
        # whenever more than max_events pile up (counted in events_dropped).
        self.events: list[KVCacheEvent] | None = [] if enable_events else None
        self.max_events = max_events
        self.events_dropped = 0
        self.epoch = 0  # bumped whenever a hash is dropped: detects stale prefix hits

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free plus cached-free (held ones excluded)."""
        return len(self.free_queue)

    def get_cached_block(self, group_id: int, block_hash: BlockHash) -> int | None:
        return self.cached[group_id].get(block_hash)

    def can_take(self, n: int) -> bool:
        """Whether ``n`` more blocks can leave the free queue to be used."""
        if n > len(self.free_queue):
            return False
        guard = self.capacity_guard
        return n <= 0 or guard is None or bool(guard(n))

    def usage(self) -> CacheUsage:
        queue = self.free_queue
        free, cached, held = queue.num_free, queue.num_cached, len(self.held_idle)
        used = self.num_usable - free - cached - held
        return CacheUsage(free=free, used=used, cached=cached, held=held, total=self.num_usable)

    def add_listener(self, listener: PoolListener) -> None:
        self.listeners.append(listener)

    def ensure_groups(self, num_groups: int) -> None:
        while len(self.cached) < num_groups:
            self.cached.append({})
            self.copies.append({})

    # -- allocation ------------------------------------------------------------------------

    def take_new_blocks(self, n: int, group_id: int) -> list[int]:
        """Take ``n`` blocks for ``group_id`` with ref count 1, evicting cached data if needed.

        The caller has checked ``can_take``.
        """
        if n <= 0:
            return []
        if self._is_plain():
            return self._take_plain(n)
        block_ids = self.free_queue.pop_n(n)
        self._claim(block_ids, group_id)
        return block_ids

    def take_by_group(self, counts: list[int]) -> list[list[int]]:
        """``take_new_blocks(counts[g], g)`` for every group in turn, in one pass."""
        total = sum(counts)
        if not total:
            return [[] for _ in counts]
        if len(counts) == 1 and self._is_plain():
            return [self._take_plain(total)]
        block_ids = self.free_queue.pop_n(total)
        self._claim(block_ids, 0)
        if total == counts[0]:
            return [block_ids] + [[] for _ in counts[1:]]
        block_group = self.block_group
        out = []
        end = 0
        for group_id, n in enumerate(counts):
            start, end = end, end + n
            taken = block_ids[start:end]
            if group_id:
                for block_id in taken:
                    block_group[block_id] = group_id
            out.append(taken)
        return out

    def _is_plain(self) -> bool:
        """Whether takes may run ``_take_plain``: one group, the pool's own queue, nobody
        to tell of evictions or allocations."""
        return len(self.cached) == 1 and type(self.free_queue) is FreeBlockQueue \
            and self.events is None and self.evict_listener is None and not self.listeners

    def _take_plain(self, n: int) -> list[int]:
        """``pop_n`` and ``_claim`` in one pass over the queue's own lists: blocks without
        cached data first, then the oldest cached ones, each dropping its hash as it leaves
        the LRU (every LRU block has one; free-stack blocks have none)."""
        queue, ref_cnt = self.free_queue, self.ref_cnt
        taken = queue.pop_uncached(n)
        k = len(taken)
        for block_id in taken:
            ref_cnt[block_id] = 1
        if k < n:
            nxt, prev, end = queue._next, queue._prev, queue._end
            block_hash, group_map, copies = self.block_hash, self.cached[0], self.copies[0]
            append = taken.append
            block_id = nxt[end]
            for _ in range(n - k):
                append(block_id)
                prev[block_id] = -1
                old_hash = block_hash[block_id]
                if copies and old_hash in copies:  # another block keeps the content cached
                    self._forget_copy(block_id, old_hash, 0)
                else:
                    del group_map[old_hash]
                    block_hash[block_id] = None
                ref_cnt[block_id] = 1
                block_id = nxt[block_id]
            nxt[end] = block_id
            prev[block_id] = end
            queue._num_cached -= n - k
            self.epoch += 1
        return taken

    def _claim(self, block_ids: list[int], group_id: int) -> None:
        """Blocks just taken from the free queue for ``group_id``: evict their cached data,
        ref count 1."""
        ref_cnt, block_hash, block_group = self.ref_cnt, self.block_hash, self.block_group
        cached, events, on_evict = self.cached, self.events, self.evict_listener
        copies = self.copies if any(self.copies) else None
        num_evicted = 0
        if len(cached) == 1 and events is None and on_evict is None and copies is None:
            group_map = cached[0]  # one group, nothing to tell: the plain loop
            for block_id in block_ids:
                old_hash = block_hash[block_id]
                if old_hash is not None:
                    del group_map[old_hash]
                    block_hash[block_id] = None
                    num_evicted = 1
                ref_cnt[block_id] = 1
                block_group[block_id] = group_id
            general: list[int] = []
        else:
            general = block_ids
        evicted: list[Evicted] = []
        for block_id in general:
            old_hash = block_hash[block_id]
            if old_hash is not None:  # a cached-free block: evict its data (inlined: hot)
                old_group = block_group[block_id]
                num_evicted += 1
                if copies is not None and old_hash in copies[old_group]:
                    self._forget_copy(block_id, old_hash, old_group)  # a copy keeps it cached
                else:
                    if on_evict is not None:
                        evicted.append((block_id, old_group, old_hash))
                    del cached[old_group][old_hash]
                    block_hash[block_id] = None
                    if events is not None:
                        events.append(KVCacheEvent("evicted", old_hash, block_id, old_group))
            ref_cnt[block_id] = 1
            block_group[block_id] = group_id
        if on_evict is not None and evicted:  # before the caller writes to the blocks
            on_evict(evicted)
        if num_evicted:
            self.epoch += 1
            if events is not None and len(events) > self.max_events:
                self._bound_events()
        for listener in self.listeners:
            listener.on_blocks_allocated(block_ids)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (cached) block of a prefix hit; null blocks are skipped."""
        ref_cnt = self.ref_cnt
        revived: list[int] = []
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            if ref_cnt[block_id] == 0:
                if self.hold_cnt[block_id]:
                    self.held_idle.discard(block_id)
                else:
                    revived.append(block_id)
            ref_cnt[block_id] += 1
        if revived:
            self.free_queue.remove_cached(revived)
            for listener in self.listeners:
                listener.on_blocks_allocated(revived)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order: the first freed is evicted first."""
        self.free_runs((block_ids,))

    def free_runs(self, runs: Iterable[Iterable[int]]) -> None:
        """``free_blocks`` for each run in turn, in one pass: each run's blocks without
        cached data are reused in the order given, the later runs' first."""
        ref_cnt, block_hash, queue = self.ref_cnt, self.block_hash, self.free_queue
        # With the pool's own queue and nothing to tell (no holds, no listeners), a block
        # with cached data joins the LRU's tail as it is met, instead of in a second pass.
        link = not self.num_holds and not self.listeners and type(queue) is FreeBlockQueue
        nxt, prev, end = (queue._next, queue._prev, queue._end) if link else ([0], [0], 0)
        last, num_linked = prev[end], 0
        cached: list[int] = []
        try:
            for run in runs:
                uncached: list[int] = []
                for block_id in run:
                    ref = ref_cnt[block_id]
                    if ref == 1:
                        ref_cnt[block_id] = 0
                        if block_hash[block_id] is None:
                            uncached.append(block_id)
                        elif link:
                            prev[block_id] = last
                            nxt[last] = block_id
                            last = block_id
                            num_linked += 1
                        else:
                            cached.append(block_id)
                    elif ref > 1:
                        ref_cnt[block_id] = ref - 1
                    elif block_id:  # the null block (ref count 0) is skipped
                        raise ValueError(f"block {block_id} freed more often than it was taken")
                if uncached:
                    self._return_free(self._keep_held(uncached), [])
        finally:
            if num_linked:  # close the LRU over the blocks linked so far
                nxt[last] = end
                prev[end] = last
                queue._num_cached += num_linked
        if cached:
            queue.push_cached(self._keep_held(cached))

    def _keep_held(self, block_ids: list[int]) -> list[int]:
        """``block_ids`` (unused now) without the held ones, which become held-idle."""
        if not self.num_holds:  # the common case: no transfer holds any block
            return block_ids
        hold_cnt = self.hold_cnt
        held = [b for b in block_ids if hold_cnt[b]]
        self.held_idle.update(held)
        return [b for b in block_ids if not hold_cnt[b]] if held else block_ids

    # -- prefix cache ----------------------------------------------------------------------

    def cache_block(self, group_id: int, block_id: int, block_hash: BlockHash,
                    parent_hash: BlockHash | None) -> bool:
        """Make a full, used block findable by its hash. False if the hash is already cached
        (another block holds the same content); the block is then a copy, found once the
        other is evicted. False, and nothing changes, if the block already has a hash."""
        if self.block_hash[block_id] is not None:
            return False
        group_map = self.cached[group_id]
        if block_hash in group_map:
            self.add_copy(group_id, block_id, block_hash)
            return False
        group_map[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        if self.events is not None:
            self.events.append(KVCacheEvent("stored", block_hash, block_id, group_id,
                                            parent_hash))
        return True

    def cache_table_blocks(self, group_id: int, table: list[int], hashes: list[BlockHash],
                           start: int, end: int) -> None:
        """``cache_block`` for ``table[start:end]`` whose hashes are ``hashes[start:end]``;
        null blocks and blocks that already have a hash (prefix hits) are skipped."""
        group_map = self.cached[group_id]
        block_hash, events = self.block_hash, self.events
        for i in range(start, end):
            block_id = table[i]
            if not block_id or block_hash[block_id] is not None:  # null block or prefix hit
                continue
            h = hashes[i]
            if h in group_map:  # same content already cached in another block
                self.add_copy(group_id, block_id, h)
                continue
            group_map[h] = block_id
            block_hash[block_id] = h
            if events is not None:
                events.append(KVCacheEvent("stored", h, block_id, group_id,
                                           hashes[i - 1] if i else None))
        if events is not None and len(events) > self.max_events:
            self._bound_events()

    def cache_new_blocks(self, group_id: int, block_ids: list[int],
                         hashes: list[BlockHash]) -> None:
        """``cache_block`` for blocks just taken (used, no hash yet) of a pool without
        events: ``block_ids[i]`` holds the content of ``hashes[i]`` (blocks past the last
        hash are not full)."""
        group_map, block_hash = self.cached[group_id], self.block_hash
        for block_id, h in zip(block_ids, hashes, strict=False):
            if h in group_map:  # same content already cached in another block
                self.add_copy(group_id, block_id, h)
            else:
                group_map[h] = block_id
                block_hash[block_id] = h

    def add_copy(self, group_id: int, block_id: int, block_hash: BlockHash) -> None:
        """``block_id`` holds content ``group_id`` already caches in another block."""
        self.block_hash[block_id] = block_hash
        self.copies[group_id].setdefault(block_hash, []).append(block_id)

    def _forget_copy(self, block_id: int, block_hash: BlockHash, group_id: int) -> None:
        """Drop the hash of a block whose content another block keeps cached."""
        self.block_hash[block_id] = None
        copies = self.copies[group_id]
        later = copies[block_hash]
        group_map = self.cached[group_id]
        if group_map[block_hash] == block_id:
            group_map[block_hash] = later.pop(0)
        else:
            later.remove(block_id)
        if not later:
            del copies[block_hash]

    def _drop_hash(self, block_id: int) -> BlockHash | None:
        """Drop a cached-free block's hash; the hash if it left the cache (no copy holds
        it), else None."""
        block_hash = self.block_hash[block_id]
        assert block_hash is not None
        group_id = self.block_group[block_id]
        if block_hash in self.copies[group_id]:
            self._forget_copy(block_id, block_hash, group_id)
            return None
        del self.cached[group_id][block_hash]
        self.block_hash[block_id] = None
        return block_hash

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Refused (False) while any block is used or held."""
        if self.usage().used or self.held_idle:
            return False
        dropped = self.free_queue.cached_ids()
        if not dropped:
            return True
        self.free_queue.remove_cached(dropped)
        for block_id in dropped:
            block_hash = self._drop_hash(block_id)
            if block_hash is not None and self.events is not None:
                self.events.append(KVCacheEvent("removed", block_hash, block_id,
                                                self.block_group[block_id]))
        self.epoch += 1
        self.free_queue.push_free(dropped)
        for listener in self.listeners:
            listener.on_blocks_released(dropped)
        return True

    def evict_cached(self, block_ids: Iterable[int]) -> int:
        """Drop the cached data of cached-free blocks (others are skipped), leaving them
        free: elastic memory gives such pages back to other engines. The evict listener
        sees each first (a tier keeps a copy). Returns how many were evicted."""
        victims = [b for b in block_ids if 0 < b < self.num_blocks and self.ref_cnt[b] == 0
                   and not self.hold_cnt[b] and self.block_hash[b] is not None]
        if not victims:
            return 0
        evicted: list[Evicted] = []  # those whose content no copy keeps cached
        for block_id in victims:
            block_hash = self._drop_hash(block_id)
            if block_hash is not None:
                evicted.append((block_id, self.block_group[block_id], block_hash))
        if evicted and self.evict_listener is not None:
            self.evict_listener(evicted)  # their content is still there
        if self.events is not None:
            self.events.extend(KVCacheEvent("evicted", h, b, g) for b, g, h in evicted)
        self.epoch += 1
        self.free_queue.remove_cached(victims)
        self.free_queue.push_free(victims)
        for listener in self.listeners:
            listener.on_blocks_released(victims)
        if self.events is not None and len(self.events) > self.max_events:
            self._bound_events()
        return len(victims)

    # -- transfer holds --------------------------------------------------------------------

    def hold(self, block_ids: Iterable[int]) -> None:
        """Keep blocks neither free nor evictable (e.g. while a transfer copies them).

        Holds nest: a block stays held until released as often as it was held. Only blocks
        with data (used or cached) can be held.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self.ref_cnt[block_id] == 0 and not self.hold_cnt[block_id] \
                    and self.block_hash[block_id] is None:
                raise ValueError(f"block {block_id} is free and holds no data; it cannot be held")
        revived = []
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0 and not self.hold_cnt[block_id]:
                revived.append(block_id)  # cached-free -> held
                self.held_idle.add(block_id)
            self.hold_cnt[block_id] += 1
        self.num_holds += len(block_ids)
        if revived:
            self.free_queue.remove_cached(revived)

    def release(self, block_ids: Iterable[int]) -> None:
        """End holds taken by ``hold``; an unused block goes back to the free queue."""
        block_ids = list(block_ids)
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if self.hold_cnt[block_id] < count:
                raise ValueError(f"block {block_id} is released more often than it is held")
        uncached, cached = [], []
        self.num_holds -= len(block_ids)
        for block_id in block_ids:
            self.hold_cnt[block_id] -= 1
            if self.hold_cnt[block_id] == 0 and self.ref_cnt[block_id] == 0:
                self.held_idle.discard(block_id)
                if self.block_hash[block_id] is None:
                    uncached.append(block_id)
                else:
                    cached.append(block_id)
        self._return_free(uncached, cached)

    def _return_free(self, uncached: list[int], cached: list[int]) -> None:
        """Blocks nobody uses or holds any more: cached ones become evictable, the others
        free (and elastic memory may unmap their pages)."""
        if cached:
            self.free_queue.push_cached(cached)
        if uncached:
            self.free_queue.push_free(uncached)
            for listener in self.listeners:
                listener.on_blocks_released(uncached)

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside 1..{self.num_blocks - 1}")

    def _bound_events(self) -> None:
        events = self.events
        assert events is not None
        drop = len(events) - self.max_events // 2
        del events[:drop]
        self.events_dropped += drop

    def take_events(self) -> list[KVCacheEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events
