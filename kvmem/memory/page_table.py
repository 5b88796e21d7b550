"""``PageTable``: an elastic KV cache's page map, placement and credit kept consistent
under one lock, for the block manager and the background upkeep.

- the page map (``kvmem.memory.page_map``): which pages are mapped, which blocks are live,
  the driver calls, and the decisions other ranks replay;
- the placement (``kvmem.memory.placement``): which free block goes next, which pages
  come free to be given back;
- the credit (``kvmem.memory.credit``): budget taken ahead for the pages an allocation
  will need, from the one ``Budget`` interface both engines' handles implement.

It backs the free-block queue (``PageAwareFreeQueue``, vLLM's ``ElasticBlockQueue``), the
block manager's hooks (pages are mapped when their blocks are allocated and may be
unmapped when all their blocks are released) and the capacity guard (``can_allocate``).
Its upkeep (``maintain_once``, ``trim_idle``) maps a few pages ahead of need, returns
credit no longer needed and unmaps wholly free pages beyond those.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvmem.errors import KvmemError
from kvmem.memory.backends import PageBackend
from kvmem.memory.budget import Budget
from kvmem.memory.credit import Credit
from kvmem.memory.page_map import PageMap, PageOp, PageState
from kvmem.memory.pages import PageGeometry
from kvmem.memory.placement import Placement

__all__ = ["OverBudgetError", "PageOp", "PageState", "PageTable"]


class OverBudgetError(KvmemError):
    """Blocks were allocated without asking ``can_allocate`` and the budget refused them."""


class PageTable:
    def __init__(self, geometry: PageGeometry, backend: PageBackend,
                 budget: Budget | None = None, *, reserve_pages: int = 2,
                 wait_timeout: float = 30.0, record_ops: bool = False,
                 owner: str = "", ledger_page_bytes: int | None = None) -> None:
        self.geo = geometry
        # one page as the budget counts it: this rank's, or every rank's of an engine whose
        # ranks all keep their KV in the budget's memory (the CPU)
        self.ledger_page_bytes = ledger_page_bytes or geometry.page_bytes
        self.backend = backend
        self.budget = budget
        self.reserve_pages = reserve_pages
        self.cond = threading.Condition()
        self.pages = PageMap(geometry, backend, self.cond, wait_timeout=wait_timeout,
                             record_ops=record_ops, owner=owner)
        self.placement = Placement(self.pages)
        self.credit = Credit(self.pages, self.placement, budget, self.ledger_page_bytes)
        # Memory was given back to other engines: no pages are mapped ahead of need (they
        # would take it straight back) until this engine allocates again.
        self.reserve_suspended = False
        # pages just unmapped here, before the ledger hears of them (rank 0 releases the
        # other ranks' copies: ``kvmem.memory.rank_files``)
        self.on_unmapped: Callable[[list[int]], None] | None = None
        # the thread giving memory back now (``giving_back``): it alone trims meanwhile
        self._giver: int | None = None

    # ---- what the parts know (the counters: ``pages``, ``placement``, ``credit``) -----------

    @property
    def state(self) -> list[PageState]:
        return self.pages.state

    @property
    def live(self) -> list[int]:
        return self.pages.live

    @property
    def mapped_pages(self) -> int:
        return self.pages.mapped_pages

    @property
    def num_free(self) -> int:
        return self.placement.num_free

    @property
    def cached(self) -> OrderedDict[int, None]:
        return self.placement.cached

    @property
    def allowed_bytes(self) -> int | None:
        return self.credit.allowed_bytes

    @property
    def attainable_bytes(self) -> int | None:
        return self.credit.attainable_bytes

    @property
    def held_bytes(self) -> int:
        return self.credit.held_bytes

    @property
    def page_bytes(self) -> int:
        """One page as the budget counts it (``ledger_page_bytes``)."""
        return self.ledger_page_bytes

    @property
    def block_bytes(self) -> int:
        """One block as the budget counts it: every slot of this rank (and of the ranks
        beside it in the budget's memory)."""
        return self.ledger_page_bytes // self.geo.blocks_per_page

    @property
    def live_kv_blocks(self) -> int:
        """Blocks running requests hold (cached-free ones excluded)."""
        return self.pages.live_blocks - self.placement.cached_live

    def usage_bytes(self) -> tuple[int, int]:
        """The bytes of live KV and of cached blocks it holds, as the ledger is told."""
        return self.live_kv_blocks * self.block_bytes, len(self.cached) * self.block_bytes

    # ---- the capacity guard -----------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` more blocks may be taken; the pages they need are paid for now
        (``Credit.can_allocate``)."""
        with self.cond:
            ok = self.credit.can_allocate(n)
            if ok:
                self.cond.notify_all()
            return ok

    def free_within(self, room_bytes: int | None) -> int:
        """Blocks an allocation could take now (``Credit.free_within``)."""
        with self.cond:
            return self.credit.free_within(room_bytes)

    # ---- free-block queue -------------------------------------------------------------------

    def _may_map(self, page: int) -> bool:
        return self.budget is None or self.credit.spare_for(page)

    def pop_n(self, n: int) -> list[int]:
        with self.cond:
            return self.placement.pop_n(n, self._may_map)

    def push_free(self, blocks: Iterable[int]) -> None:
        with self.cond:
            self.placement.push_free(blocks)
            self.cond.notify_all()

    def push_cached(self, blocks: Iterable[int]) -> None:
        with self.cond:
            self.placement.push_cached(blocks)

    def remove_cached(self, blocks: Iterable[int]) -> None:
        with self.cond:
            self.placement.remove_cached(blocks)

    def remove_free(self, block: int) -> None:
        """Take one uncached free block out of the queue (the null block at startup)."""
        with self.cond:
            self.placement.remove_free(block)

    def free_ids(self) -> list[int]:
        with self.cond:
            return self.placement.free_ids()

    def cached_ids(self) -> list[int]:
        with self.cond:
            return self.placement.cached_ids()

    # ---- block manager hooks ----------------------------------------------------------------

    def on_blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """Mark blocks live and map their pages before the caller writes to them."""
        to_map: list[int] = []
        block_ids = list(block_ids)
        with self.cond:
            self.placement.liveness_changed(self.pages.mark_live(block_ids), +1)
            # every block handed out (new, or a cached one revived by a prefix hit) was in
            # what can_allocate promised
            self.credit.allocated(len(block_ids))
            self.reserve_suspended = False
            for page in sorted({self.geo.page_of(b) for b in block_ids}):
                self.pages.wait_settled(page)
                if self.pages.state[page] is PageState.UNMAPPED:
                    if not self.credit.take_page():
                        raise OverBudgetError(
                            "elastic KV memory is at its limit; allocations must be checked "
                            "with the pool's capacity guard first")
                    self._begin_map(page)
                    to_map.append(page)
            self.cond.notify_all()  # the reserve may need topping up
        for page in to_map:
            self._map(page)

    def on_blocks_released(self, block_ids: Iterable[int]) -> None:
        """Blocks hold no KV any more: their pages may be unmapped once wholly unused."""
        with self.cond:
            self.placement.liveness_changed(self.pages.mark_dead(block_ids), -1)
            self.cond.notify_all()

    def map_now(self, page: int) -> None:
        """Map one page synchronously (the null block's page at startup)."""
        with self.cond:
            self.pages.wait_settled(page)
            if self.pages.state[page] is not PageState.UNMAPPED:
                return
            if not self.credit.take_page():
                raise OverBudgetError(
                    f"no room for one KV page ({self.page_bytes} bytes): this engine's limit "
                    "is below it, or other engines hold the device's total limit")
            self._begin_map(page)
        self._map(page)

    def pin(self, block: int) -> None:
        """Keep a block live for good (the null block), so its page is never unmapped."""
        self.on_blocks_allocated([block])

    # ---- mapping and unmapping ----------------------------------------------------------

    def _begin_map(self, page: int) -> None:
        self.pages.begin_map(page)
        self.placement.opened(page)

    def _map(self, page: int) -> None:
        """Map a page in MAPPING state (lock not held), then mark it MAPPED."""
        try:
            self.pages.map(page)
        except BaseException:
            with self.cond:
                self.placement.reopened(page)
                self.pages.map_aborted(page)
                self.credit.release(1)
                self.cond.notify_all()
            raise
        with self.cond:
            self.pages.mapped(page)
            self.cond.notify_all()

    def _begin_unmap(self, page: int) -> None:
        self.pages.begin_unmap(page)
        self.placement.closing(page)

    def _unmap(self, page: int) -> None:
        try:
            self.pages.unmap(page)
        finally:
            self._unmapped(page)

    def _unmapped(self, page: int) -> None:
        """Bookkeeping once ``page``'s bytes are unmapped (or failed to be); its bytes go
        back to the budget now."""
        self._closed([page])
        if self.on_unmapped is not None:
            self.on_unmapped([page])
        self.credit.release(1)

    def _closed(self, pages: list[int]) -> None:
        """The page map and placement once ``pages`` are unmapped (one lock for all)."""
        with self.cond:
            self.pages.unmapped(pages)
            self.placement.closed(pages)
            self.cond.notify_all()

    # ---- upkeep -----------------------------------------------------------------------------

    def _spare_target(self) -> int:
        """Free blocks to keep mapped ahead of need."""
        reserve = 0 if self.reserve_suspended else self.reserve_pages
        return reserve * self.geo.blocks_per_page + self.credit.promised_blocks

    def _premap_page(self) -> int | None:
        """A page to map ahead of need, its budget taken; None if none is wanted or paid."""
        if self.placement.free_on_mapped >= self._spare_target():
            return None
        page = self.placement.lowest_unmapped()
        if page is None:
            return None
        if self.credit.spare_for(page):
            self.credit.credit_pages -= 1
            return page
        if self.credit.over_cap(1) or not self.credit.acquire(1):
            return None
        return page

    def _trim_target(self) -> int:
        """Free blocks to keep mapped when trimming."""
        return self.credit.promised_blocks if self.credit.over_cap() else self._spare_target()

    def _may_trim(self, target: int) -> bool:
        """Whether one more page may go and still leave ``target`` free blocks covered."""
        return self.credit.covered_blocks() - self.geo.blocks_per_page >= target

    def maintain_once(self) -> bool:
        """Do one step of background work (return spare credit, pre-map or trim one page).

        Returns whether anything was done. Safe to call from any thread.
        """
        with self.cond:
            page = self._premap_page()
            mapping = page is not None
            if page is not None:
                self._begin_map(page)
            elif self.credit.return_surplus():
                return True
            else:
                if self._giver not in (None, threading.get_ident()) \
                        or not self._may_trim(self._trim_target()):
                    return False
                page = next(iter(self.placement.trimmable()), None)
                if page is None:
                    return False
                self._begin_unmap(page)
        if mapping:
            self._map(page)
        else:
            self._unmap(page)
        return True

    def trim_idle(self) -> int:
        """Unmap every page ``maintain_once`` would trim, at once: one unmap per slot for
        each run of consecutive pages, rather than one per slot and page (giving back
        thousands of pages to another engine). Returns the pages unmapped."""
        with self.cond:
            # maintain_once's choice, page after page (``_may_trim``: each page taken out
            # covers k blocks fewer; the target stays, as pages taken out here still count
            # as held until they are unmapped), with one sort
            k = self.geo.blocks_per_page
            n = max(0, (self.credit.covered_blocks() - self._trim_target()) // k)
            pages = self.placement.trimmable()[:n]
            for page in pages:
                self.pages.begin_unmap(page)
            self.placement.closing_idle(pages)
        pages.sort()
        try:
            self.pages.unmap_runs(pages, self._closed)
        finally:
            if pages and self.on_unmapped is not None:
                self.on_unmapped(pages)
            self.credit.release(len(pages))  # one ledger write for them all
        return len(pages)

    # ---- giving back to other engines ----------------------------------------------------

    @contextlib.contextmanager
    def giving_back(self) -> Iterator[None]:
        """Memory goes back from this thread meanwhile: pages its evictions free are
        trimmed here, in runs (``trim_idle``), and ``maintain_once`` on other threads (the
        memory thread, woken by the same ask) trims none of them one by one: each would
        take the lock and the interpreter from the give-back for a page."""
        with self.cond:
            self._giver = threading.get_ident()
        try:
            yield
        finally:
            with self.cond:
                self._giver = None

    def idle_pages(self) -> int:
        """Mapped pages whose blocks are all free (they can be unmapped now)."""
        with self.cond:
            return self.placement.idle_pages()

    def cached_victims(self, pages: int) -> list[int]:
        """The cached-free blocks of up to ``pages`` mapped pages that hold no live block,
        pages taken in the order their blocks were cached (least recently used first):
        evicted from the prefix cache, those pages can be given back."""
        with self.cond:
            return self.placement.cached_victims(pages)

    def pages_in_use(self) -> int:
        """Pages holding at least one block of a running request (the null block's
        included); pages of cached-free blocks only do not count."""
        with self.cond:
            return self.placement.pages_in_use()

    # ---- other ranks ----------------------------------------------------------------------

    def apply_ops(self, ops: Iterable[PageOp]) -> None:
        """Replay the leader's mapping decisions, in order (on ranks other than 0)."""
        for op in ops:
            with self.cond:
                self.pages.check_replay(op)
                if op.kind == "map":
                    self._begin_map(op.page)
                else:
                    self._begin_unmap(op.page)
            if op.kind == "map":
                self._map(op.page)
            else:
                self._unmap(op.page)

    def pages_in_flight(self) -> int:
        return self.pages.pages_in_flight()

    def has_ops(self) -> bool:
        """Whether mapping decisions are waiting to be drained."""
        with self.cond:
            return self.pages.has_ops()

    def drain_ops(self) -> list[PageOp]:
        """Mapping decisions since the last call, in order (for the other ranks)."""
        with self.cond:
            return self.pages.drain_ops()
