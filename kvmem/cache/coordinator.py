"""The coordinator: what spans all KV groups of a (possibly hybrid) model.

- A prefix hit must be valid for every group at once. Each group's rule gives its longest
  valid hit up to a limit; the coordinator lowers the limit to the shortest answer and
  asks again until every group agrees (full attention's answer can simply be cut, a
  sliding window's cannot: a shorter hit needs other blocks).
- An allocation is all-or-nothing across groups: the blocks every group needs are counted
  first (cached-free blocks that a prefix hit revives count as taken; held blocks are not
  free), and only when all of it fits are blocks taken. Blocks that left a window (or a
  state the request no longer needs) are released first either way, as vLLM does: the
  request never reads them again.
- A hit may name ``LOAD_BLOCK`` instead of a block id (a block an offload tier holds): a
  new block is taken for it, counted with the rest, and its data is loaded afterwards.
- A state group (linear attention, Mamba) takes its blocks by its own rule
  (``StateManager.grow``): null entries, then at most one new block at the end, for the
  tokens the model computes (lookahead slots excluded: draft models keep no state).
"""

from __future__ import annotations

from kvmem.cache.block_pool import BlockPool
from kvmem.cache.hashing import BlockHash
from kvmem.cache.managers import SingleTypeManager, StateManager, make_manager
from kvmem.cache.results import NULL_BLOCK_ID, NoCapacity
from kvmem.spec.layout import KVGroup

LOAD_BLOCK = -1  # in a hit: take a new block here (its data comes from an offload tier)


def longest_common_hit(managers: list[SingleTypeManager], hashes: list[BlockHash],
                       max_blocks: int) -> tuple[int, tuple[list[int], ...]]:
    """Longest hit (in blocks, at most ``max_blocks``) valid for every manager's group, and
    its block table prefix per group (``managers[i].group_index == i``).

    Each group's rule gives its longest valid hit up to a limit; the limit is lowered to the
    shortest answer and asked again until every group agrees. The managers may look blocks
    up anywhere (``make_manager`` over any mapping with ``get``), not only in the pool.
    """
    if len(managers) == 1:
        blocks = managers[0].find_longest_cache_hit(hashes, max_blocks)
        return len(blocks), (blocks,)
    # cheap, cuttable answers first: they lower the limit for the others
    search_order = sorted(managers, key=lambda m: not m.prefix_closed)
    limit = max_blocks
    results: list[list[int] | None] = [None] * len(managers)
    while True:
        stable = True
        for manager in search_order:
            found = results[manager.group_index]
            if found is None or len(found) > limit:
                if found is not None and manager.prefix_closed:
                    found = found[:limit]
                else:
                    found = manager.find_longest_cache_hit(hashes, limit)
                results[manager.group_index] = found
            if len(found) < limit:
                limit = len(found)
                stable = False
        if stable:
            return limit, tuple(results)  # type: ignore[arg-type]


class KVCacheCoordinator:
    def __init__(self, groups: list[KVGroup], pool: BlockPool, block_size: int, *,
                 state_checkpoints: bool = True) -> None:
        pool.ensure_groups(len(groups))
        self.pool = pool
        self.block_size = block_size
        self.managers: list[SingleTypeManager] = [
            make_manager(group, i, block_size, pool.cached[i],
                         state_checkpoints=state_checkpoints)
            for i, group in enumerate(groups)]
        self.num_groups = len(groups)
        self._releasing = [m for m in self.managers if m.releases_blocks]
        self.state_managers: list[StateManager] = [
            m for m in self.managers if isinstance(m, StateManager)]

    def find_longest_cache_hit(self, hashes: list[BlockHash],
                               max_blocks: int) -> tuple[int, tuple[list[int], ...]]:
        """Longest hit (in blocks, at most ``max_blocks``) valid for every group, and its
        block table prefix per group."""
        return longest_common_hit(self.managers, hashes, max_blocks)

    def allocate(self, tables: list[list[int]], skipped: list[int], num_computed: int,
                 num_tokens: int, hit: tuple[list[int], ...] | None,
                 num_lookahead: int = 0) -> tuple[list[int], ...] | NoCapacity:
        """Make every group's table cover ``num_tokens`` tokens, or take nothing.

        ``num_computed`` tokens are already computed (blocks wholly before their attention
        span are released first); ``hit`` is a prefix hit to adopt into empty tables (its
        ``LOAD_BLOCK`` entries become new blocks); the last ``num_lookahead`` of
        ``num_tokens`` are speculative slots (state groups take none for them).
        Returns the new block ids per group (a state group's null entries included), or
        ``NoCapacity``.
        """
        pool = self.pool
        num_required = -(-num_tokens // self.block_size)
        # 1. release (also when the rest does not fit: those blocks are never read again)
        reclaimed = self._release(tables, skipped, num_computed) if self._releasing else 0
        if hit:
            hit_lengths = [len(blocks) for blocks in hit]
            new_counts = [max(0, num_required - len(table) - extra)
                          for table, extra in zip(tables, hit_lengths, strict=True)]
        else:
            hit_lengths = [0] * self.num_groups
            new_counts = [num_required - len(table) if num_required > len(table) else 0
                          for table in tables]
        padding: list[int] = []
        if self.state_managers:
            padding = [0] * self.num_groups
            state_required = -(-(num_tokens - num_lookahead) // self.block_size)
            for manager in self.state_managers:
                g = manager.group_index
                padding[g], new_counts[g] = manager.grow(
                    state_required, len(tables[g]) + hit_lengths[g])
        to_load = [blocks.count(LOAD_BLOCK) for blocks in hit] if hit else None
        taken = sum(new_counts)
        if hit:
            taken += sum(to_load)  # type: ignore[arg-type]
            ref_cnt, hold_cnt = pool.ref_cnt, pool.hold_cnt
            for blocks in hit:
                for block_id in blocks:
                    if block_id > 0 and ref_cnt[block_id] == 0 and not hold_cnt[block_id]:
                        taken += 1  # a cached-free block leaves the free queue
        elif not taken:
            return tuple([] for _ in tables)

        # 2. does it fit?
        if taken > len(pool.free_queue) or (
                taken > reclaimed and pool.capacity_guard is not None
                and not pool.capacity_guard(taken - reclaimed)):
            return self.no_capacity(taken, reclaimed, num_computed, num_required, hit_lengths,
                                    tables)

        # 3. commit: adopt the hit, take new blocks
        new_ids: list[list[int]] = [[] for _ in tables]
        if hit:
            for blocks in hit:  # revive the hit's cached blocks before taking new ones
                pool.touch(b for b in blocks if b != LOAD_BLOCK)
            for g, blocks in enumerate(hit):
                if to_load[g]:  # type: ignore[index]
                    new_ids[g] = pool.take_new_blocks(to_load[g], g)  # type: ignore[index]
                    loaded = iter(new_ids[g])
                    blocks = [next(loaded) if b == LOAD_BLOCK else b for b in blocks]
                tables[g].extend(blocks)
                manager = self.managers[g]
                if manager.releases_blocks:
                    skipped[g] = manager.first_needed_block(num_computed)
        for g, ids in enumerate(pool.take_by_group(new_counts)):
            if padding and padding[g]:
                ids = [NULL_BLOCK_ID] * padding[g] + ids
            if ids:
                tables[g] += ids
                new_ids[g] += ids
        return tuple(new_ids)

    def _release(self, tables: list[list[int]], skipped: list[int], num_computed: int) -> int:
        """Release the table entries that left the attention span of the token at
        ``num_computed`` (each span's last block first, as vLLM frees them), replacing them
        with the null block; returns how many blocks became free."""
        runs = []
        for manager in self._releasing:
            g = manager.group_index
            table = tables[g]
            end = manager.first_needed_block(num_computed)
            if end > len(table):
                end = len(table)
            start = skipped[g]
            if end > start:
                run = table[start:end]
                run.reverse()
                table[start:end] = [NULL_BLOCK_ID] * (end - start)
                skipped[g] = end
                runs.append(run)
        if not runs:
            return 0
        free_queue = self.pool.free_queue
        before = len(free_queue)
        self.pool.free_runs(runs)
        return len(free_queue) - before

    def no_capacity(self, taken: int, reclaimed: int, num_computed: int, num_required: int,
                    hit_lengths: list[int], tables: list[list[int]]) -> NoCapacity:
        """The ``NoCapacity`` for an allocation that needs ``taken`` blocks and gets
        ``reclaimed`` back; says whether the request could fit in an otherwise empty pool."""
        pool = self.pool
        available = pool.num_free_blocks  # the reclaimed blocks are already back
        # blocks the request would hold afterwards: could it fit in an otherwise empty pool?
        kept = 0
        for manager, table, extra in zip(self.managers, tables, hit_lengths, strict=True):
            if isinstance(manager, StateManager):
                kept += manager.max_blocks_held(num_required, num_computed)
                continue
            kept += max(len(table) + extra, num_required)
            if manager.releases_blocks:
                kept -= min(manager.first_needed_block(num_computed), num_required)
        can_ever_fit = kept <= pool.num_usable
        if taken > available:
            held = len(pool.held_idle)
            note = f" ({held} held by transfers)" if held else ""
            reason = f"needs {taken} free blocks, {available} available{note}"
        else:
            reason = f"memory limit: {taken - reclaimed} more blocks are not allowed"
        return NoCapacity(reason, needed_blocks=taken, available_blocks=available,
                          can_ever_fit=can_ever_fit)
