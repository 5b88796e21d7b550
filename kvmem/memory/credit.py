"""Credit in an elastic KV cache: budget taken ahead for pages not mapped yet.

``can_allocate(n)`` is asked before ``n`` blocks are handed out; the pages those blocks
need are paid for then, from the budget (``kvmem.memory.budget.Budget``), and kept as
credit, so that the allocation that follows cannot fail. Credit pays for mapping a page
later (``take_page``); what is no longer needed goes back (``return_surplus``). Over
the budget's latest cap (a lowered limit, or other engines' shares grown back) it takes
nothing, and free blocks of the pages it must give back do not count.

It reads the placement's counts (``kvmem.memory.placement``) and the page map's mapped
pages; all calls are made under the page table's lock.
"""

from __future__ import annotations

from math import ceil

from kvmem.memory.budget import Budget
from kvmem.memory.page_map import PageMap
from kvmem.memory.placement import Placement


class Credit:
    def __init__(self, pages: PageMap, placement: Placement, budget: Budget | None,
                 page_bytes: int) -> None:
        self.pages = pages
        self.placement = placement
        self.budget = budget
        self.page_bytes = page_bytes  # one page as the budget counts it
        self.k = pages.geo.blocks_per_page
        self.credit_pages = 0  # budget taken for pages not mapped yet
        self.promised_blocks = 0  # blocks can_allocate said yes to, not yet allocated

    # ---- the budget's view ------------------------------------------------------------------

    @property
    def allowed_bytes(self) -> int | None:
        """The most the engine may hold now (None: no limit), as of the ledger's latest
        write: after a take, what the take left, not the last heartbeat's."""
        return None if self.budget is None else self.budget.allowed_bytes

    @property
    def attainable_bytes(self) -> int | None:
        """The most it could hold once other engines gave back what they only cache."""
        return None if self.budget is None else self.budget.attainable_bytes

    @property
    def held_bytes(self) -> int:
        return (self.pages.mapped_pages + self.credit_pages) * self.page_bytes

    def acquire(self, pages: int) -> bool:
        return self.budget is None or self.budget.try_acquire(pages * self.page_bytes)

    def release(self, pages: int) -> None:
        if self.budget is not None and pages:
            self.budget.release(pages * self.page_bytes)

    def over_cap(self, extra_pages: int = 0) -> bool:
        cap = self.allowed_bytes
        return cap is not None and self.held_bytes + extra_pages * self.page_bytes > cap

    # ---- paying for pages -------------------------------------------------------------------

    def take_page(self) -> bool:
        """Pay for mapping one page: from credit, else from the budget."""
        if self.credit_pages:
            self.credit_pages -= 1
            return True
        return self.acquire(1)

    def spare_for(self, page: int) -> bool:
        """Whether credit may pay for mapping ``page`` without leaving an owed page unpaid."""
        placement = self.placement
        return self.credit_pages > placement.owed_pages - placement.is_owed(page)

    def covered_blocks(self) -> int:
        """Blocks an allocation may take without new budget: free on mapped pages, plus
        the free blocks of the unmapped pages that credit pays for."""
        placement = self.placement
        return placement.free_on_mapped + self.credit_pages * self.k - placement.taken_unmapped

    def over_blocks(self) -> int:
        """Blocks' worth of whole pages held above the latest cap (0 when under it)."""
        cap = self.allowed_bytes
        held = self.held_bytes
        if cap is None or held <= cap:
            return 0
        return ceil((held - cap) / self.page_bytes) * self.k

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` more blocks may be taken; the pages they need are paid for now.

        When the budget cannot pay for new pages, evicting cached-free blocks (which sit on
        mapped pages) may still cover the request."""
        covered = self.covered_blocks() - self.over_blocks()
        if n > covered:
            need = ceil((n - max(0, covered)) / self.k)
            if self.over_blocks() == 0 and self.acquire(need):
                self.credit_pages += need
            elif n > covered + len(self.placement.cached):
                return False
        self.promised_blocks = n
        return True

    def allocated(self, blocks: int) -> None:
        """``blocks`` were handed out: every one was in what ``can_allocate`` promised."""
        self.promised_blocks = max(0, self.promised_blocks - blocks)

    def free_within(self, room_bytes: int | None) -> int:
        """Blocks an allocation could take now: free blocks on mapped pages or on pages
        credit pays for, cached-free blocks, and free blocks of unmapped pages that
        ``room_bytes`` more budget would pay for (None: no limit); over the limit
        (``room_bytes`` negative), less the blocks of the pages it must give back."""
        placement = self.placement
        if room_bytes is None:
            extra = placement.num_free
        elif room_bytes < 0:
            extra = -ceil(-room_bytes / self.page_bytes) * self.k
        else:
            extra = room_bytes // self.page_bytes * self.k
        return max(0, min(placement.num_free, self.covered_blocks() + extra)
                   + len(placement.cached))

    def return_surplus(self) -> bool:
        """Give the budget back what ``can_allocate`` took and no longer needs; whether
        there was any. Kept: one page per owed page, and enough to cover what
        ``can_allocate`` promised (blocks handed out but not yet allocated count twice
        here, briefly: safe side)."""
        placement = self.placement
        promise = self.promised_blocks - placement.free_on_mapped + placement.taken_unmapped
        surplus = self.credit_pages - max(placement.owed_pages, ceil(max(0, promise) / self.k))
        if surplus <= 0:
            return False
        self.credit_pages -= surplus
        self.release(surplus)
        return True
