"""Page state and page-aware placement for an elastic KV cache.

The ``PageTable`` knows, for every page, whether it is mapped, how many of its blocks hold
live KV and which of its blocks are free. It backs three things:

- the free-block queue (``PageAwareFreeQueue``): hands out blocks on mapped pages first,
  the fullest such page first, so live blocks pack densely and sparse pages drain;
- the block manager's hooks: pages are mapped when their blocks are allocated and become
  unmappable when all their blocks are released;
- the budget: ``can_allocate(n)`` tells the block manager whether ``n`` more blocks fit
  under the shared limit, taking the bytes they need from the ledger up front (as
  *credit*) so that the following allocation cannot fail.

Every page moves UNMAPPED -> MAPPING -> MAPPED -> UNMAPPING -> UNMAPPED, each transition
under one lock, so a page is never mapped twice or unmapped while in use; the driver call
itself runs outside the lock. A thread that needs a page another thread is mapping waits
for it, bounded by ``wait_timeout``.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from math import ceil

from kvmem.errors import KvmemError
from kvmem.memory.backends import BackendError, PageBackend
from kvmem.memory.budget import Budget
from kvmem.memory.pages import PageGeometry
from kvmem.memory.wait import wait_for


class PageState(IntEnum):
    UNMAPPED = 0
    MAPPING = 1
    MAPPED = 2
    UNMAPPING = 3


class OverBudgetError(KvmemError):
    """Blocks were allocated without asking ``can_allocate`` and the budget refused them."""


@dataclass(frozen=True)
class PageOp:
    """One mapping decision, replayed in order on every tensor-parallel rank."""

    kind: str  # "map" or "unmap"
    page: int


class PageTable:
    def __init__(self, geometry: PageGeometry, backend: PageBackend,
                 budget: Budget | None = None, *, reserve_pages: int = 2,
                 wait_timeout: float = 30.0, record_ops: bool = False,
                 owner: str = "") -> None:
        self.geo = geometry
        self.owner = owner  # who maps, for errors: "rank 1 of 2"
        self.backend = backend
        self.budget = budget
        self.reserve_pages = reserve_pages
        self.wait_timeout = wait_timeout
        self.cond = threading.Condition()
        n_pages, k = geometry.num_pages, geometry.blocks_per_page
        self.state = [PageState.UNMAPPED] * n_pages
        self.live = [0] * n_pages  # live blocks per page
        self._block_live = bytearray(geometry.num_blocks)
        self.live_blocks = 0
        # Free blocks per page in queue order; all blocks start free.
        self._free: list[OrderedDict[int, None]] = [
            OrderedDict.fromkeys(geometry.blocks_of(p)) for p in range(n_pages)]
        self.num_free = geometry.num_blocks
        self.free_on_mapped = 0  # free blocks on MAPPED or MAPPING pages
        # Cached-free blocks (evictable prefix-cache data): their pages stay mapped. A
        # pool may keep them live (kvmem's) or release them (vLLM's): ``cached_live``
        # counts those it keeps live, so that live KV = live_blocks - cached_live.
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.cached_live = 0
        self._taken_unmapped = 0  # blocks handed out from pages not yet being mapped
        # Unmapped (or unmapping) pages some of whose blocks were handed out: each will need
        # one page of budget when its blocks are allocated, so credit is kept for them.
        self._owed_pages = 0
        # Mapped pages with free blocks, bucketed by how many are free (fewest first wins).
        self._buckets: list[set[int]] = [set() for _ in range(k + 1)]
        self._min_bucket = k + 1
        self._unmapped_heap = list(range(n_pages))  # lazily cleaned: lowest index first
        self.mapped_pages = 0  # MAPPED + MAPPING + UNMAPPING: pages whose bytes are held
        self.credit_pages = 0  # budget taken for pages not mapped yet
        self.promised_blocks = 0  # blocks can_allocate said yes to, not yet allocated
        # caps read from the ledger at its latest write (the budget's, when it keeps them)
        self._allowed_bytes: int | None = None
        self._attainable_bytes: int | None = None
        # Memory was given back to other engines: no pages are mapped ahead of need (they
        # would take it straight back) until this engine allocates again.
        self.reserve_suspended = False
        self.maps = 0
        self.unmaps = 0
        self._ops: list[PageOp] | None = [] if record_ops else None
        # pages just unmapped here, before the ledger hears of them (rank 0 releases the
        # other ranks' copies: ``kvmem.memory.rank_files``)
        self.on_unmapped: Callable[[list[int]], None] | None = None

    # ---- budget -------------------------------------------------------------------------

    @property
    def allowed_bytes(self) -> int | None:
        """The most the engine may hold now (None: no limit), as of the ledger's latest
        write: after a take, what the take left, not the last heartbeat's."""
        return getattr(self.budget, "allowed_bytes", self._allowed_bytes)

    @allowed_bytes.setter
    def allowed_bytes(self, value: int | None) -> None:
        self._allowed_bytes = value

    @property
    def attainable_bytes(self) -> int | None:
        """The most it could hold once other engines gave back what they only cache."""
        return getattr(self.budget, "attainable_bytes", self._attainable_bytes)

    @property
    def page_bytes(self) -> int:
        return self.geo.page_bytes

    @property
    def held_bytes(self) -> int:
        return (self.mapped_pages + self.credit_pages) * self.geo.page_bytes

    def _take_page_budget(self) -> bool:
        if self.credit_pages:
            self.credit_pages -= 1
            return True
        return self.budget is None or self.budget.try_acquire(self.geo.page_bytes)

    def _is_owed(self, page: int) -> bool:
        return len(self._free[page]) < self.geo.blocks_per_page

    def _spare_credit(self, page: int) -> bool:
        """Whether credit may pay for mapping ``page`` without leaving an owed page unpaid."""
        return self.credit_pages > self._owed_pages - self._is_owed(page)

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` more blocks may be taken; the pages they need are paid for now.

        When the budget cannot pay for new pages, evicting cached-free blocks (which sit on
        mapped pages) may still cover the request. Over its limit (lowered, or others' share
        grew back), free blocks on pages it must give back do not count.
        """
        k = self.geo.blocks_per_page
        with self.cond:
            covered = self._covered_blocks() - self._over_blocks()
            if n > covered:
                need = ceil((n - max(0, covered)) / k)
                if self._over_blocks() == 0 and (
                        self.budget is None or self.budget.try_acquire(need * self.page_bytes)):
                    self.credit_pages += need
                elif n > covered + len(self.cached):
                    return False
            self.promised_blocks = n
            self.cond.notify_all()
            return True

    def _over_blocks(self) -> int:
        """Blocks' worth of whole pages held above the latest cap (0 when under it)."""
        cap = self.allowed_bytes
        if cap is None or self.held_bytes <= cap:
            return 0
        return ceil((self.held_bytes - cap) / self.page_bytes) * self.geo.blocks_per_page

    def free_within(self, room_bytes: int | None) -> int:
        """Blocks an allocation could take now: free blocks on mapped pages or on pages
        credit pays for, cached-free blocks, and free blocks of unmapped pages that
        ``room_bytes`` more budget would pay for (None: no limit); over the limit
        (``room_bytes`` negative), less the blocks of the pages it must give back."""
        k = self.geo.blocks_per_page
        with self.cond:
            if room_bytes is None:
                extra = self.num_free
            elif room_bytes < 0:
                extra = -ceil(-room_bytes / self.page_bytes) * k
            else:
                extra = room_bytes // self.page_bytes * k
            return max(0, min(self.num_free, self._covered_blocks() + extra) + len(self.cached))

    # ---- free-block queue -----------------------------------------------------------------

    def _bucket_move(self, page: int, old: int, new: int) -> None:
        if self.state[page] not in (PageState.MAPPED, PageState.MAPPING):
            return
        if old:
            self._buckets[old].discard(page)
        if new:
            self._buckets[new].add(page)
            self._min_bucket = min(self._min_bucket, new)

    def _lowest_unmapped(self) -> int | None:
        while self._unmapped_heap:
            page = self._unmapped_heap[0]
            if self.state[page] is PageState.UNMAPPED and self._free[page]:
                return page
            heapq.heappop(self._unmapped_heap)
        return None

    def _pick_page(self) -> int | None:
        """Page of the next uncached free block to hand out, or None to use a cached one."""
        k = self.geo.blocks_per_page
        while self._min_bucket <= k and not self._buckets[self._min_bucket]:
            self._min_bucket += 1
        if self._min_bucket <= k:
            return min(self._buckets[self._min_bucket])  # lowest index: deterministic
        page = self._lowest_unmapped()
        if page is not None and (self.budget is None or not self.cached
                                 or self._spare_credit(page)):
            return page
        if self.cached:
            return None  # evict cached data rather than map a page the budget has not paid for
        # Pages being unmapped are the last resort; their blocks get remapped on allocation.
        return next((p for p, s in enumerate(self.state)
                     if s is PageState.UNMAPPING and self._free[p]), None)

    def pop_n(self, n: int) -> list[int]:
        with self.cond:
            if n > self.num_free + len(self.cached):
                raise ValueError(f"asked for {n} blocks, only "
                                 f"{self.num_free + len(self.cached)} are free")
            taken = []
            for _ in range(n):
                page = self._pick_page()
                if page is None:
                    block = self.cached.popitem(last=False)[0]
                    self.cached_live -= self._block_live[block]
                    taken.append(block)
                    continue
                block, _ = self._free[page].popitem(last=False)
                self._on_free_count_change(page, -1)
                taken.append(block)
            return taken

    def push_free(self, blocks: Iterable[int]) -> None:
        with self.cond:
            for block in blocks:
                page = self.geo.page_of(block)
                if block in self._free[page] or block in self.cached:
                    raise ValueError(f"block {block} is already free")
                self._free[page][block] = None
                self._on_free_count_change(page, +1)
            self.cond.notify_all()

    def push_cached(self, blocks: Iterable[int]) -> None:
        with self.cond:
            for block in blocks:
                self.cached[block] = None
                self.cached_live += self._block_live[block]

    def remove_cached(self, blocks: Iterable[int]) -> None:
        with self.cond:
            for block in blocks:
                del self.cached[block]
                self.cached_live -= self._block_live[block]

    def remove_free(self, block: int) -> None:
        """Take one uncached free block out of the queue (the null block at startup)."""
        page = self.geo.page_of(block)
        with self.cond:
            del self._free[page][block]
            self._on_free_count_change(page, -1)

    def free_ids(self) -> list[int]:
        with self.cond:
            return [b for page in self._free for b in page]

    def cached_ids(self) -> list[int]:
        with self.cond:
            return list(self.cached)

    def _on_free_count_change(self, page: int, delta: int) -> None:
        now = len(self._free[page])
        self.num_free += delta
        if self.state[page] in (PageState.MAPPED, PageState.MAPPING):
            self.free_on_mapped += delta
            self._bucket_move(page, now - delta, now)
        else:
            k = self.geo.blocks_per_page
            if (delta < 0 and now == k - 1) or (delta > 0 and now == k):
                self._owed_pages -= delta
            if self.state[page] is PageState.UNMAPPED:
                self._taken_unmapped -= delta
                if delta > 0 and now == 1:
                    heapq.heappush(self._unmapped_heap, page)

    # ---- block manager hooks ----------------------------------------------------------------

    def on_blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """Mark blocks live and map their pages before the caller writes to them."""
        to_map: list[int] = []
        block_ids = list(block_ids)
        with self.cond:
            pages: set[int] = set()
            fresh = 0
            for b in block_ids:
                page = self.geo.page_of(b)
                pages.add(page)
                if not self._block_live[b]:
                    self._block_live[b] = 1
                    self.live[page] += 1
                    fresh += 1
                    self.cached_live += b in self.cached
            self.live_blocks += fresh
            # every block handed out (new, or a cached one revived by a prefix hit) was in
            # what can_allocate promised
            self.promised_blocks = max(0, self.promised_blocks - len(block_ids))
            self.reserve_suspended = False
            for page in sorted(pages):
                self._wait_settled(page)
                if self.state[page] is PageState.UNMAPPED:
                    if not self._take_page_budget():
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
            gone = 0
            for b in block_ids:
                if self._block_live[b]:
                    self._block_live[b] = 0
                    self.live[self.geo.page_of(b)] -= 1
                    gone += 1
                    self.cached_live -= b in self.cached
            self.live_blocks -= gone
            self.cond.notify_all()

    def _wait_settled(self, page: int) -> None:
        state = self.state[page]
        if state in (PageState.MAPPING, PageState.UNMAPPING):
            doing = "mapping" if state is PageState.MAPPING else "unmapping"
            wait_for(lambda: self.state[page] in (PageState.UNMAPPED, PageState.MAPPED),
                     cond=self.cond, timeout=self.wait_timeout,
                     what=f"another thread to finish {doing} KV page {page}")

    # ---- mapping ----------------------------------------------------------------------------

    def _begin_map(self, page: int) -> None:
        self._owed_pages -= self._is_owed(page)
        self.state[page] = PageState.MAPPING
        self.mapped_pages += 1
        free = len(self._free[page])
        self._taken_unmapped -= self.geo.blocks_per_page - free
        self.free_on_mapped += free
        self._bucket_move(page, 0, free)
        if self._ops is not None:
            self._ops.append(PageOp("map", page))

    def _map(self, page: int) -> None:
        """Map a page in MAPPING state (lock not held), then mark it MAPPED."""
        done: list[tuple[int, int]] = []
        try:
            for offset, length in self.geo.regions(page):
                self.backend.map(offset, length)
                done.append((offset, length))
        except BaseException as e:
            for offset, length in done:  # a page is mapped in every slot or in none
                self.backend.unmap(offset, length)
            with self.cond:
                self._abort_map(page)
            if isinstance(e, BackendError) and self.owner:
                raise BackendError(f"{self.owner}: KV page {page}: {e}") from e
            raise
        with self.cond:
            self.state[page] = PageState.MAPPED
            self.maps += 1
            self.cond.notify_all()

    def _abort_map(self, page: int) -> None:
        free = len(self._free[page])
        self._bucket_move(page, free, 0)
        self.free_on_mapped -= free
        self.state[page] = PageState.UNMAPPED
        self._taken_unmapped += self.geo.blocks_per_page - free
        self._owed_pages += self._is_owed(page)
        self.mapped_pages -= 1
        heapq.heappush(self._unmapped_heap, page)
        if self.budget is not None:
            self.budget.release(self.page_bytes)
        self.cond.notify_all()

    def map_now(self, page: int) -> None:
        """Map one page synchronously (the null block's page at startup)."""
        with self.cond:
            self._wait_settled(page)
            if self.state[page] is not PageState.UNMAPPED:
                return
            if not self._take_page_budget():
                raise OverBudgetError(
                    f"no room for one KV page ({self.page_bytes} bytes): this engine's limit "
                    "is below it, or other engines hold the device's total limit")
            self._begin_map(page)
        self._map(page)

    def pin(self, block: int) -> None:
        """Keep a block live for good (the null block), so its page is never unmapped."""
        self.on_blocks_allocated([block])

    # ---- background maintenance -------------------------------------------------------------

    def _spare_pages_target(self) -> int:
        reserve = 0 if self.reserve_suspended else self.reserve_pages
        return reserve * self.geo.blocks_per_page + self.promised_blocks

    def _over_cap(self, extra_pages: int = 0) -> bool:
        cap = self.allowed_bytes
        return cap is not None and self.held_bytes + extra_pages * self.page_bytes > cap

    def _premap_page(self) -> int | None:
        """A page to map ahead of need, its budget taken; None if none is wanted or paid."""
        if self.free_on_mapped >= self._spare_pages_target():
            return None
        page = self._lowest_unmapped()
        if page is None:
            return None
        if self._spare_credit(page):
            self.credit_pages -= 1
            return page
        if self._over_cap(1) or not (self.budget is None
                                     or self.budget.try_acquire(self.page_bytes)):
            return None
        return page

    def _trim_target(self) -> int:
        """Free blocks to keep mapped when trimming."""
        return self.promised_blocks if self._over_cap() else self._spare_pages_target()

    def _trimmable(self) -> list[int]:
        """Wholly free mapped pages, highest index first: trimming them keeps live blocks
        packed at the low end."""
        k = self.geo.blocks_per_page
        return [p for p in sorted(self._buckets[k], reverse=True)
                if self.state[p] is PageState.MAPPED and self.live[p] == 0]

    def _pick_trim(self) -> int | None:
        if self._covered_blocks() - self.geo.blocks_per_page < self._trim_target():
            return None
        return next(iter(self._trimmable()), None)

    def _begin_unmap(self, page: int) -> None:
        """Take a wholly free mapped page out of use, to be unmapped (under ``cond``)."""
        k = self.geo.blocks_per_page
        self.state[page] = PageState.UNMAPPING
        self.free_on_mapped -= k
        self._buckets[k].discard(page)
        if self._ops is not None:
            self._ops.append(PageOp("unmap", page))

    def _covered_blocks(self) -> int:
        """Blocks an allocation may take without new budget: free on mapped pages, plus
        the free blocks of the unmapped pages that credit pays for."""
        k = self.geo.blocks_per_page
        return self.free_on_mapped + self.credit_pages * k - self._taken_unmapped

    def _surplus_credit(self) -> int:
        # Kept: one page per owed page, and enough to cover what can_allocate promised.
        # (Blocks handed out but not yet allocated count twice here, briefly: safe side.)
        k = self.geo.blocks_per_page
        promise = self.promised_blocks - self.free_on_mapped + self._taken_unmapped
        return self.credit_pages - max(self._owed_pages, ceil(max(0, promise) / k))

    # ---- giving back to other engines ----------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """One block's bytes in every slot."""
        return self.geo.block_slot_bytes * self.geo.num_slots

    def idle_pages(self) -> int:
        """Mapped pages whose blocks are all free (they can be unmapped now)."""
        with self.cond:
            k = self.geo.blocks_per_page
            return sum(1 for p in self._buckets[k]
                       if self.state[p] is PageState.MAPPED and self.live[p] == 0)

    def cached_victims(self, pages: int) -> list[int]:
        """The cached-free blocks of up to ``pages`` mapped pages that hold no live block,
        pages taken in the order their blocks were cached (least recently used first):
        evicted from the prefix cache, those pages can be given back."""
        if pages <= 0:
            return []
        with self.cond:
            by_page: dict[int, list[int]] = {}  # in LRU order of each page's first block
            for block in self.cached:
                by_page.setdefault(self.geo.page_of(block), []).append(block)
            chosen = [blocks for page, blocks in by_page.items()
                      if self.state[page] is PageState.MAPPED
                      and self.live[page] == sum(self._block_live[b] for b in blocks)]
        return [b for blocks in chosen[:pages] for b in blocks]

    @property
    def live_kv_blocks(self) -> int:
        """Blocks running requests hold (cached-free ones excluded)."""
        return self.live_blocks - self.cached_live

    def pages_in_use(self) -> int:
        """Pages holding at least one block of a running request (the null block's
        included); pages of cached-free blocks only do not count."""
        with self.cond:
            counts = list(self.live)
            for block in self.cached:
                counts[self.geo.page_of(block)] -= self._block_live[block]
            return sum(1 for n in counts if n > 0)

    def maintain_once(self) -> bool:
        """Do one step of background work (return spare credit, pre-map or trim one page).

        Returns whether anything was done. Safe to call from any thread.
        """
        with self.cond:
            page = self._premap_page()
            if page is not None:
                self._begin_map(page)
                action = "map"
            elif (surplus := self._surplus_credit()) > 0:
                # Budget taken by can_allocate but no longer needed goes back to the ledger.
                self.credit_pages -= surplus
                if self.budget is not None:
                    self.budget.release(surplus * self.page_bytes)
                return True
            else:
                page = self._pick_trim()
                if page is None:
                    return False
                self._begin_unmap(page)
                action = "unmap"
        if action == "map":
            self._map(page)
        else:
            self._unmap(page)
        return True

    def trim_idle(self) -> int:
        """Unmap every page ``maintain_once`` would trim, at once: one unmap per slot for
        each run of consecutive pages, rather than one per slot and page (giving back
        thousands of pages to another engine). Returns the pages unmapped."""
        k = self.geo.blocks_per_page
        pages = []
        with self.cond:
            # _pick_trim's choice, page after page, with one sort (the target stays: pages
            # taken out here still count as held until they are unmapped)
            target = self._trim_target()
            for page in self._trimmable():
                if self._covered_blocks() - k < target:
                    break
                self._begin_unmap(page)
                pages.append(page)
        pages.sort()
        merge = getattr(self.backend, "unmaps_ranges", False)  # else one call per mapping
        runs = [[p] for p in pages[:1]]
        for p in pages[1:]:
            if merge and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        try:
            for run in runs:
                try:
                    for offset, length in self.geo.regions(run[0]):
                        self.backend.unmap(offset, length * len(run))
                finally:
                    for page in run:
                        self._unmapped(page, release=False)
        finally:
            if pages and self.on_unmapped is not None:
                self.on_unmapped(pages)
            if self.budget is not None and pages:  # one ledger write for them all
                self.budget.release(len(pages) * self.page_bytes)
        return len(pages)

    def _unmap(self, page: int) -> None:
        try:
            for offset, length in self.geo.regions(page):
                self.backend.unmap(offset, length)
        finally:
            self._unmapped(page)

    def _unmapped(self, page: int, release: bool = True) -> None:
        """Bookkeeping once ``page``'s bytes are unmapped (or failed to be); ``release``:
        its bytes go back to the budget now."""
        with self.cond:
            self.state[page] = PageState.UNMAPPED
            self._taken_unmapped += self.geo.blocks_per_page - len(self._free[page])
            self.mapped_pages -= 1
            self.unmaps += 1
            if self._free[page]:
                heapq.heappush(self._unmapped_heap, page)
            self.cond.notify_all()
        if release and self.on_unmapped is not None:
            self.on_unmapped([page])
        if release and self.budget is not None:
            self.budget.release(self.page_bytes)

    def apply_ops(self, ops: Iterable[PageOp]) -> None:
        """Replay the leader's mapping decisions, in order (on ranks other than 0)."""
        for op in ops:
            page = op.page
            with self.cond:
                self._wait_settled(page)
                want = PageState.UNMAPPED if op.kind == "map" else PageState.MAPPED
                if self.state[page] is not want:
                    raise KvmemError(f"cannot {op.kind} KV page {page}: it is "
                                     f"{self.state[page].name.lower()} on this rank (ranks "
                                     "disagree about the page map)")
                if op.kind == "map":
                    self._begin_map(page)
                else:
                    self.state[page] = PageState.UNMAPPING
                    self._owed_pages += self._is_owed(page)
                    self.free_on_mapped -= len(self._free[page])
                    self._buckets[len(self._free[page])].discard(page)
            if op.kind == "map":
                self._map(page)
            else:
                self._unmap(page)

    def pages_in_flight(self) -> int:
        return sum(s in (PageState.MAPPING, PageState.UNMAPPING) for s in self.state)

    def has_ops(self) -> bool:
        """Whether mapping decisions are waiting to be drained."""
        with self.cond:
            return bool(self._ops)

    def drain_ops(self) -> list[PageOp]:
        """Mapping decisions since the last call, in order (for the other ranks)."""
        with self.cond:
            ops, self._ops = (self._ops or []), ([] if self._ops is not None else None)
            return ops
