"""Placement in an elastic KV cache: which free block is handed out next, and which pages
come free to be given back.

Blocks go to mapped pages first, the fullest such page first (fewest free blocks), so
live blocks pack densely and sparse pages drain; then to the lowest unmapped page; then
cached-free blocks (evictable prefix-cache data, least recently used first) are taken;
pages being unmapped are the last resort. Within a page, blocks leave in the order they
were freed. Pages given back are chosen the other way round: wholly free pages, highest
index first, so live blocks stay at the low end.

It reads the page map's states and live counts (``kvmem.memory.page_map``) and keeps
the counts the credit works from (``kvmem.memory.credit``): free blocks on mapped
pages, blocks handed out from unmapped pages, and the unmapped pages they are on. All
calls are made under the page table's lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvmem.memory.page_map import OPEN, PageMap, PageState


class Placement:
    def __init__(self, pages: PageMap) -> None:
        self.pages = pages
        geo = pages.geo
        self.k = k = geo.blocks_per_page
        n_pages = geo.num_pages
        # Free blocks per page in queue order; all blocks start free.
        self._free: list[OrderedDict[int, None]] = [
            OrderedDict.fromkeys(geo.blocks_of(p)) for p in range(n_pages)]
        self.num_free = geo.num_blocks
        self.free_on_mapped = 0  # free blocks on MAPPED or MAPPING pages
        # Cached-free blocks (evictable prefix-cache data): their pages stay mapped. A
        # pool may keep them live (kvmem's) or release them (vLLM's): ``cached_live``
        # counts those it keeps live, so that live KV = live_blocks - cached_live.
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.cached_live = 0
        self.taken_unmapped = 0  # blocks handed out from pages not yet being mapped
        # Unmapped (or unmapping) pages some of whose blocks were handed out: each will need
        # one page of budget when its blocks are allocated.
        self.owed_pages = 0
        # Mapped pages with free blocks, bucketed by how many are free (fewest first wins).
        self._buckets: list[set[int]] = [set() for _ in range(k + 1)]
        self._min_bucket = k + 1
        self._unmapped_heap = list(range(n_pages))  # lazily cleaned: lowest index first

    # ---- handing out and taking back --------------------------------------------------------

    def pop_n(self, n: int, may_map: Callable[[int], bool]) -> list[int]:
        """``n`` blocks in placement order; ``may_map(page)``: whether an unmapped page may
        be used while cached-free blocks could be evicted instead (its budget is paid)."""
        if n > self.num_free + len(self.cached):
            raise ValueError(f"asked for {n} blocks, only "
                             f"{self.num_free + len(self.cached)} are free")
        taken = []
        for _ in range(n):
            page = self._pick_page(may_map)
            if page is None:
                block = self.cached.popitem(last=False)[0]
                self.cached_live -= self.pages.block_live[block]
                taken.append(block)
                continue
            block, _ = self._free[page].popitem(last=False)
            self._free_count_changed(page, -1)
            taken.append(block)
        return taken

    def _pick_page(self, may_map: Callable[[int], bool]) -> int | None:
        """Page of the next uncached free block to hand out, or None to use a cached one."""
        k = self.k
        while self._min_bucket <= k and not self._buckets[self._min_bucket]:
            self._min_bucket += 1
        if self._min_bucket <= k:
            return min(self._buckets[self._min_bucket])  # lowest index: deterministic
        page = self.lowest_unmapped()
        if page is not None and (not self.cached or may_map(page)):
            return page
        if self.cached:
            return None  # evict cached data rather than map a page the budget has not paid for
        # Pages being unmapped are the last resort; their blocks get remapped on allocation.
        return next((p for p, s in enumerate(self.pages.state)
                     if s is PageState.UNMAPPING and self._free[p]), None)

    def push_free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            page = self.pages.geo.page_of(block)
            if block in self._free[page] or block in self.cached:
                raise ValueError(f"block {block} is already free")
            self._free[page][block] = None
            self._free_count_changed(page, +1)

    def push_cached(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.cached[block] = None
            self.cached_live += self.pages.block_live[block]

    def remove_cached(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            del self.cached[block]
            self.cached_live -= self.pages.block_live[block]

    def remove_free(self, block: int) -> None:
        page = self.pages.geo.page_of(block)
        del self._free[page][block]
        self._free_count_changed(page, -1)

    def liveness_changed(self, blocks: Iterable[int], delta: int) -> None:
        """``blocks`` became live (+1) or stopped being live (-1) in the page map."""
        self.cached_live += delta * sum(b in self.cached for b in blocks)

    def free_ids(self) -> list[int]:
        return [b for page in self._free for b in page]

    def cached_ids(self) -> list[int]:
        return list(self.cached)

    def is_owed(self, page: int) -> bool:
        """Whether some of ``page``'s blocks are handed out."""
        return len(self._free[page]) < self.k

    def _free_count_changed(self, page: int, delta: int) -> None:
        now = len(self._free[page])
        self.num_free += delta
        state = self.pages.state[page]
        if state in OPEN:
            self.free_on_mapped += delta
            self._bucket_move(page, now - delta, now)
        else:
            k = self.k
            if (delta < 0 and now == k - 1) or (delta > 0 and now == k):
                self.owed_pages -= delta
            if state is PageState.UNMAPPED:
                self.taken_unmapped -= delta
                if delta > 0 and now == 1:
                    heapq.heappush(self._unmapped_heap, page)

    def _bucket_move(self, page: int, old: int, new: int) -> None:
        if old:
            self._buckets[old].discard(page)
        if new:
            self._buckets[new].add(page)
            self._min_bucket = min(self._min_bucket, new)

    def lowest_unmapped(self) -> int | None:
        """The lowest unmapped page with free blocks."""
        while self._unmapped_heap:
            page = self._unmapped_heap[0]
            if self.pages.state[page] is PageState.UNMAPPED and self._free[page]:
                return page
            heapq.heappop(self._unmapped_heap)
        return None

    # ---- pages opening and closing ---------------------------------------------------------

    def opened(self, page: int) -> None:
        """An unmapped page is being mapped: its free blocks go to the mapped ones."""
        free = len(self._free[page])
        self.owed_pages -= self.is_owed(page)
        self.taken_unmapped -= self.k - free
        self.free_on_mapped += free
        self._bucket_move(page, 0, free)

    def reopened(self, page: int) -> None:
        """A page being mapped failed to map: it is unmapped again."""
        free = len(self._free[page])
        self._bucket_move(page, free, 0)
        self.free_on_mapped -= free
        self.closed([page])
        self.owed_pages += self.is_owed(page)

    def closing(self, page: int) -> None:
        """A mapped page is being unmapped: its free blocks are no longer on a mapped page."""
        free = len(self._free[page])
        self.owed_pages += self.is_owed(page)
        self.free_on_mapped -= free
        self._buckets[free].discard(page)

    def closing_idle(self, pages: list[int]) -> None:
        """``closing`` for wholly free mapped pages (``trimmable``), at once."""
        self.free_on_mapped -= self.k * len(pages)
        self._buckets[self.k].difference_update(pages)

    def closed(self, pages: Iterable[int]) -> None:
        """Pages are unmapped now (their states already say so)."""
        k, free, heap = self.k, self._free, self._unmapped_heap
        for page in pages:
            n = len(free[page])
            self.taken_unmapped += k - n
            if n:
                heapq.heappush(heap, page)

    # ---- pages to give back ---------------------------------------------------------------

    def trimmable(self) -> list[int]:
        """Wholly free mapped pages, highest index first: trimming them keeps live blocks
        packed at the low end."""
        state, live = self.pages.state, self.pages.live
        return [p for p in sorted(self._buckets[self.k], reverse=True)
                if state[p] is PageState.MAPPED and live[p] == 0]

    def idle_pages(self) -> int:
        """Mapped pages whose blocks are all free (they can be unmapped now)."""
        state, live = self.pages.state, self.pages.live
        return sum(1 for p in self._buckets[self.k]
                   if state[p] is PageState.MAPPED and live[p] == 0)

    def cached_victims(self, pages: int) -> list[int]:
        """The cached-free blocks of up to ``pages`` mapped pages that hold no live block
        but theirs, pages in the order their blocks were cached (least recently used
        first), each page's blocks in that order too. The scan of the cache stops once
        those pages' blocks are all seen: a give-back looks at what it takes, not at the
        whole cache."""
        if pages <= 0:
            return []
        geo, state, live = self.pages.geo, self.pages.state, self.pages.live
        block_live, cached = self.pages.block_live, self.cached
        if self.k == 1:  # a page per block: a page qualifies by its one block
            mapped = PageState.MAPPED
            return list(itertools.islice(
                (b for b in cached if state[b] is mapped and live[b] == block_live[b]), pages))
        chosen: dict[int, list[int]] = {}  # page -> its blocks seen so far, in LRU order
        looked: set[int] = set()
        missing = 0  # blocks of chosen pages not yet seen
        for block in cached:
            page = geo.page_of(block)
            if page not in looked:
                looked.add(page)
                on_page = [b for b in geo.blocks_of(page) if b in cached]
                if (len(chosen) < pages and state[page] is PageState.MAPPED
                        and live[page] == sum(block_live[b] for b in on_page)):
                    chosen[page] = []
                    missing += len(on_page)
            blocks = chosen.get(page)
            if blocks is not None:
                blocks.append(block)
                missing -= 1
                if missing == 0 and len(chosen) == pages:
                    break
        return [b for blocks in chosen.values() for b in blocks]

    def pages_in_use(self) -> int:
        """Pages holding at least one live block that is not cached-free."""
        counts = list(self.pages.live)
        for block in self.cached:
            counts[self.pages.geo.page_of(block)] -= self.pages.block_live[block]
        return sum(1 for n in counts if n > 0)
