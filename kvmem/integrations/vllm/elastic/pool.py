"""Elastic KV memory, scheduler side: vLLM's block pool over kvmem's page table.

vLLM's ``BlockPool`` keeps its free blocks in a ``FreeKVCacheBlockQueue`` and asks it how
many are free before every allocation (``KVCacheManager.allocate_slots``: too few, and
the request waits or another is preempted). ``ElasticBlockQueue`` takes that queue's
place, with the same methods, over ``kvmem.memory.page_table.PageTable``:

- **Placement.** Blocks go to pages already mapped first (the page with the fewest free
  blocks first), then to new pages, then cached-free blocks are evicted (vLLM's own
  order for those: least recently used first), so live blocks stay packed.
- **The limit.** ``num_free_blocks`` counts the free blocks on mapped pages, the
  cached-free blocks, and only as many blocks of unmapped pages as the engine's room in
  the ledger pays for; beyond that the pool reports no free block and vLLM waits or
  preempts as it always does. The room is read from the ledger at the first count of
  each step (``LedgerView``) and then follows the engine's own takes and releases; bytes
  for new pages are taken from the ledger when the blocks are handed out. If another
  engine took the room within the step, the blocks vLLM already counted are handed out
  anyway (an overdraft, logged) and the pages come back as blocks are freed. A step the
  limit left with nothing to schedule backs off 10 ms, rather than spin.
- **Pages follow the pool.** Mapping decisions are recorded in order; ``ElasticPool.end_step``
  returns them as block ranges for the step's message to every worker, which maps them
  before the step's forward. Pages whose blocks are all free are given back at the next
  step end (the workers unmap them before the next step's forward); over the limit,
  cached-free blocks of otherwise unused pages are evicted from vLLM's prefix cache first.
- **Giving back to other engines.** When another engine on the device asks for memory
  (``kvmem.memory.sharing``), the step end gives back free pages and then pages holding
  only cached blocks, least recently used first, never below the engine's floor. An idle
  engine takes no steps: ``LedgerWatch`` looks at the ledger every 50 ms and wakes vLLM's
  engine core loop, which gives back on its own thread.
- **Released at once on the CPU.** With ``release.WorkerFiles`` connected, every page
  decision is also applied to the workers' KV memory files from here, so a page given
  back is free when the scheduler decides, and an idle engine needs no step (its
  workers are not woken); the workers apply the same decisions at their next step.
  Without it (a GPU, a batch queue), pages given back are unmapped by the workers with
  the next step, and vLLM keeps stepping until they have been.

The null block (block 0, taken by vLLM's pool at construction) is mapped on every worker
at start-up; its page is paid for here before anything else. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvmem.cache.results import NULL_BLOCK_ID as NULL_BLOCK
from kvmem.errors import KvmemError
from kvmem.integrations.vllm.elastic.release import BlockRange, WorkerFiles
from kvmem.memory import reclaim
from kvmem.memory.budget import BudgetState, EngineBudget
from kvmem.memory.page_table import PageState, PageTable
from kvmem.memory.pages import PageGeometry

log = logging.getLogger("vllm.kvmem.elastic")  # shown and formatted as vLLM's own lines

BACKOFF_S = 0.01
__all__ = ["BlockRange", "ElasticBlockQueue", "ElasticPool", "LedgerView", "PoolStats"]


class _MappedElsewhere:
    """The page table's backend in the scheduler: pages are decided here and mapped by
    the workers, so mapping here is bookkeeping only."""

    granularity = 1

    def reserve(self, nbytes: int) -> None:
        pass

    def map(self, offset: int, length: int) -> None:
        pass

    def unmap(self, offset: int, length: int) -> None:
        pass

    def tensor(self, offset: int, length: int) -> Any:
        raise KvmemError("the scheduler holds no KV tensors")

    def close(self) -> None:
        pass


class LedgerView:
    """The engine's ledger entry as the scheduler uses it: the bytes it may still take,
    and an overdraft for blocks vLLM has already counted as free.

    The room is read from the ledger once per step: at the step end (to give back what is
    over the limit) and again at the first free-block count of the next step, so vLLM
    schedules against the ledger as it is then; within a step it only follows the
    engine's own takes and releases. That keeps the count vLLM checks once per request
    from falling, before that request's blocks are handed out, by more than it took (vLLM
    checks again per allocation and would raise)."""

    def __init__(self, budget: EngineBudget) -> None:
        self.budget = budget
        self.room: int | None = None  # None: no limit applies
        self.stale = True  # read the ledger at the next count
        self.overdrawn = 0  # bytes taken past the limits since the last read
        self._forced = False

    # The view applies the limit itself (``room``, read once a step): the page table
    # keeps under no cap of its own, and vLLM's scheduler reads no attainable size.
    allowed_bytes: int | None = None
    attainable_bytes: int | None = None

    def refresh(self, live_bytes: int, cached_bytes: int = 0) -> BudgetState:
        """Read the room from the ledger, recording the bytes of live and cached blocks."""
        state = self.budget.report(live_bytes, cached_bytes)
        self.room = None if state.allowed_bytes is None else \
            state.allowed_bytes - state.held_bytes
        self.stale = False
        self.overdrawn = 0
        return state

    def try_acquire(self, nbytes: int) -> bool:
        if not self._forced and self.room is not None and nbytes > self.room:
            return False
        taken = self.budget.try_acquire(nbytes)
        if not taken and self._forced:
            self.budget.take(nbytes)
            if not self.overdrawn:
                log.warning("kvmem: the KV memory limit was reached within a step (another "
                            "engine took the room); %d bytes taken past it for blocks vLLM "
                            "had already counted, given back as blocks are freed", nbytes)
            self.overdrawn += nbytes
            taken = True
        if taken and self.room is not None:
            self.room -= nbytes
        return taken

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)
        if self.room is not None:
            self.room += nbytes

    @contextmanager
    def overdraft(self) -> Iterator[None]:
        self._forced = True
        try:
            yield
        finally:
            self._forced = False


@dataclass(frozen=True)
class PoolStats:
    mapped_pages: int
    live_blocks: int  # including the null block
    free_blocks: int  # uncached free blocks
    cached_blocks: int
    page_bytes: int
    held_bytes: int
    maps: int
    unmaps: int


class ElasticPool:
    """The page state of one vLLM engine's KV cache, decided in the scheduler process.

    ``num_blocks``: vLLM's pool; ``blocks_per_page``: blocks that map and unmap together;
    ``block_bytes``: one block's bytes in the ledger's accounting (every worker of the
    engine on the ledger's device). A last page that vLLM's pool does not fill is left
    out (fewer than ``blocks_per_page`` blocks: never handed out). ``files``: the
    workers' KV memory files, once connected (``connect_files``)."""

    def __init__(self, *, num_blocks: int, blocks_per_page: int, block_bytes: int,
                 budget: EngineBudget, files: WorkerFiles | None = None) -> None:
        k = blocks_per_page
        num_pages = num_blocks // k
        if num_pages < 2:
            raise KvmemError(f"vLLM's KV cache has {num_blocks} blocks, fewer than two pages "
                             f"of {k}; give it more KV memory")
        geometry = PageGeometry.build(num_slots=1, block_slot_bytes=block_bytes,
                                      max_blocks=num_pages * k, granularity=1,
                                      blocks_per_page=k)
        self.num_blocks = num_blocks
        self.blocks_per_page = k
        self.block_bytes = block_bytes
        self.view = LedgerView(budget)
        self.table = PageTable(geometry, _MappedElsewhere(), self.view, reserve_pages=0,
                               record_ops=True)
        # The null block's page, before anything else runs.
        self.table.map_now(self.table.geo.page_of(NULL_BLOCK))
        self.table.pin(NULL_BLOCK)
        self.table.remove_free(NULL_BLOCK)
        self.files = files or WorkerFiles()
        self._pending: list[BlockRange] = []  # decisions the workers have not been sent
        self._step_needed = False  # some unmap among them is not released yet
        self._collect()  # the rest of the null block's page, if any
        self.seq = 0  # step messages sent
        self.limited = False  # the limit held free blocks back from vLLM since the last step

    @property
    def page_bytes(self) -> int:
        return self.table.page_bytes

    def queue(self, blocks: Sequence[Any],
              evict: Callable[[set[int]], None]) -> ElasticBlockQueue:
        """The free-block queue for vLLM's pool over ``blocks`` (its ``KVCacheBlock``s);
        ``evict(ids)`` drops blocks from vLLM's prefix cache."""
        if len(blocks) != self.num_blocks:
            raise KvmemError(f"vLLM's block pool has {len(blocks)} blocks, its KV cache "
                             f"config {self.num_blocks}")
        self._evict = evict
        return ElasticBlockQueue(self, blocks)

    # -- step ends ------------------------------------------------------------------------
    def end_step(self, idle: bool = False) -> list[BlockRange]:
        """Give back what is free, then every mapping decision since the last call, as
        block ranges in order (block 0 excluded: workers map it at start-up).

        ``idle``: the step scheduled nothing. If the limit held blocks back meanwhile,
        the engine is waiting for memory (another engine's, or a lowered limit): back off
        10 ms and read the ledger again, rather than spin."""
        if idle and self.limited:
            time.sleep(BACKOFF_S)
        self.limited = False
        self.maintain()
        self.view.stale = True  # the next step reads the ledger again
        self.seq += 1
        self._collect()
        ops, self._pending, self._step_needed = self._pending, [], False
        return ops

    def connect_files(self, files: Sequence[Any]) -> bool:
        """Release pages in the workers' KV memory files from here from now on (``files``:
        ``release.WorkerFile`` of every worker); whether it is in use."""
        k, t = self.blocks_per_page, self.table
        mapped = [(max(p * k, NULL_BLOCK + 1), p * k + k) for p in range(t.geo.num_pages)
                  if t.state[p] != PageState.UNMAPPED]
        return self.files.connect(files, [r for r in mapped if r[0] < r[1]], NULL_BLOCK)

    def _collect(self) -> None:
        """Take the page table's new decisions for the workers, releasing what they give
        back in the workers' files when those are connected."""
        fresh = self._drain()
        if fresh and not self.files.apply(fresh):
            self._step_needed |= any(not mapping for mapping, _, _ in fresh)
        self._pending += fresh

    def maintain(self) -> None:
        """Read the ledger; give back what other engines ask for or what is over the
        limit (``kvmem.memory.reclaim``: free pages, then cached-only pages); trim free
        pages."""
        t, budget = self.table, self.view.budget
        state = self.view.refresh(*t.usage_bytes())
        reclaim.answer(t, budget, state,
                       lambda n: reclaim.give_back(t, n, budget.floor_bytes, self._drop_cached))
        reclaim.trim(t)

    def _drop_cached(self, victims: list[int]) -> None:
        """Evict cached-free blocks from vLLM's prefix cache: they become free blocks."""
        self._evict(set(victims))
        self.table.remove_cached(victims)
        self.table.push_free(victims)

    def want(self, blocks: int) -> bool:
        """Requests need ``blocks`` more: ask other engines for what the device total
        keeps from them (once for all of them); whether some is coming."""
        return reclaim.ask_for_blocks(self.table, self.view.budget, blocks)

    @property
    def used_bytes(self) -> int:
        return self.table.live_kv_blocks * self.block_bytes

    def has_pending(self) -> bool:
        """Whether pages given back (free pages are, first) still wait for a step of the
        workers to be unmapped. Maps wait for the step that uses their blocks."""
        self.maintain()
        self._collect()
        return self._step_needed

    def _drain(self) -> list[BlockRange]:
        k = self.blocks_per_page
        ranges: list[BlockRange] = []
        for op in self.table.drain_ops():
            start, end = max(op.page * k, NULL_BLOCK + 1), op.page * k + k
            if start >= end:
                continue
            mapping = op.kind == "map"
            if ranges and ranges[-1][0] == mapping and ranges[-1][2] == start:
                ranges[-1] = (mapping, ranges[-1][1], end)
            else:
                ranges.append((mapping, start, end))
        return ranges

    def stats(self) -> PoolStats:
        t = self.table
        with t.cond:
            return PoolStats(mapped_pages=t.mapped_pages, live_blocks=t.pages.live_blocks,
                             free_blocks=t.num_free, cached_blocks=len(t.cached),
                             page_bytes=self.page_bytes, held_bytes=t.held_bytes,
                             maps=t.pages.maps, unmaps=t.pages.unmaps)

    def close(self) -> None:
        self.files.close()
        self.view.budget.close()


class ElasticBlockQueue:
    """vLLM's free-block queue (``FreeKVCacheBlockQueue``'s methods), page-aware and under
    the engine's limit. vLLM frees blocks without cached data with ``prepend_n`` (reused
    first) and blocks holding prefix-cache data with ``append_n`` (evicted last)."""

    def __init__(self, pool: ElasticPool, blocks: Sequence[Any]) -> None:
        self.pool = pool
        self.blocks = blocks

    @property
    def num_free_blocks(self) -> int:
        view = self.pool.view
        if view.stale:  # the first count of a step
            view.refresh(self.pool.used_bytes)
        table, room = self.pool.table, view.room
        n = table.free_within(room)
        if room is not None and n < table.num_free + len(table.cached):
            self.pool.limited = True
        return n

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        if n == 0:
            return []
        table = self.pool.table
        # Budget for the new pages these blocks need, or else evicting cached blocks:
        # asked before the blocks are picked, so that placement knows which it is.
        table.can_allocate(n)
        with self.pool.view.overdraft():  # vLLM counted them as free: they are handed out
            ids = table.pop_n(n)
            table.on_blocks_allocated(ids)
        return [self.blocks[i] for i in ids]

    def remove(self, block: Any) -> None:
        """A free block is used again (a prefix-cache hit on a cached-free block)."""
        table, bid = self.pool.table, block.block_id
        if bid in table.cached:
            table.remove_cached([bid])
        else:
            table.remove_free(bid)
        with self.pool.view.overdraft():
            table.on_blocks_allocated([bid])

    def prepend_n(self, blocks: Sequence[Any]) -> None:
        ids = [b.block_id for b in blocks]
        self.pool.table.on_blocks_released(ids)
        self.pool.table.push_free(ids)

    def append_n(self, blocks: Sequence[Any]) -> None:
        ids = [b.block_id for b in blocks]
        self.pool.table.on_blocks_released(ids)
        self.pool.table.push_cached(ids)

    def append(self, block: Any) -> None:
        self.append_n([block])

    def get_all_free_blocks(self) -> list[Any]:
        table = self.pool.table
        return [self.blocks[i] for i in table.free_ids() + table.cached_ids()]
