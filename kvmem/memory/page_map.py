"""The page map of an elastic KV cache: which pages are mapped, which blocks hold live KV.

Every page moves UNMAPPED -> MAPPING -> MAPPED -> UNMAPPING -> UNMAPPED. The state changes
happen under the caller's lock (``cond``, the page table's), so a page is never mapped
twice or unmapped while in use; the driver calls (``map``, ``unmap``, ``unmap_runs``) run
outside it. A thread that needs a page another thread is mapping waits for it, bounded by
``wait_timeout``.

With tensor parallelism, rank 0 records each mapping decision (``PageOp``) and the other
ranks replay them in order: ``drain_ops`` there, ``check_replay`` here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

from kvmem.errors import KvmemError
from kvmem.memory.backends import BackendError, PageBackend
from kvmem.memory.pages import PageGeometry
from kvmem.memory.wait import wait_for


class PageState(IntEnum):
    UNMAPPED = 0
    MAPPING = 1
    MAPPED = 2
    UNMAPPING = 3


OPEN = (PageState.MAPPED, PageState.MAPPING)  # pages whose free blocks may be handed out


@dataclass(frozen=True)
class PageOp:
    """One mapping decision, replayed in order on every tensor-parallel rank."""

    kind: str  # "map" or "unmap"
    page: int


class PageMap:
    def __init__(self, geometry: PageGeometry, backend: PageBackend,
                 cond: threading.Condition, *, wait_timeout: float = 30.0,
                 record_ops: bool = False, owner: str = "") -> None:
        self.geo = geometry
        self.backend = backend
        self.cond = cond
        self.wait_timeout = wait_timeout
        self.owner = owner  # who maps, for errors: "rank 1 of 2"
        n_pages = geometry.num_pages
        self.state = [PageState.UNMAPPED] * n_pages
        self.live = [0] * n_pages  # live blocks per page
        self.block_live = bytearray(geometry.num_blocks)
        self.live_blocks = 0
        self.mapped_pages = 0  # MAPPED + MAPPING + UNMAPPING: pages whose bytes are held
        self.maps = 0
        self.unmaps = 0
        self._ops: list[PageOp] | None = [] if record_ops else None

    # ---- live blocks (under ``cond``) -----------------------------------------------------

    def mark_live(self, block_ids: Iterable[int]) -> list[int]:
        """Blocks now hold KV; the ones that did not before."""
        fresh = []
        for b in block_ids:
            if not self.block_live[b]:
                self.block_live[b] = 1
                self.live[self.geo.page_of(b)] += 1
                fresh.append(b)
        self.live_blocks += len(fresh)
        return fresh

    def mark_dead(self, block_ids: Iterable[int]) -> list[int]:
        """Blocks hold no KV any more; the ones that did."""
        gone = []
        for b in block_ids:
            if self.block_live[b]:
                self.block_live[b] = 0
                self.live[self.geo.page_of(b)] -= 1
                gone.append(b)
        self.live_blocks -= len(gone)
        return gone

    # ---- states (under ``cond``) ------------------------------------------------------------

    def wait_settled(self, page: int) -> None:
        """Wait until no other thread is mapping or unmapping ``page``."""
        state = self.state[page]
        if state in (PageState.MAPPING, PageState.UNMAPPING):
            doing = "mapping" if state is PageState.MAPPING else "unmapping"
            wait_for(lambda: self.state[page] in (PageState.UNMAPPED, PageState.MAPPED),
                     cond=self.cond, timeout=self.wait_timeout,
                     what=f"another thread to finish {doing} KV page {page}")

    def begin_map(self, page: int) -> None:
        self.state[page] = PageState.MAPPING
        self.mapped_pages += 1
        self._record("map", page)

    def mapped(self, page: int) -> None:
        self.state[page] = PageState.MAPPED
        self.maps += 1

    def map_aborted(self, page: int) -> None:
        self.state[page] = PageState.UNMAPPED
        self.mapped_pages -= 1

    def begin_unmap(self, page: int) -> None:
        self.state[page] = PageState.UNMAPPING
        self._record("unmap", page)

    def unmapped(self, pages: list[int]) -> None:
        state = self.state
        for page in pages:
            state[page] = PageState.UNMAPPED
        self.mapped_pages -= len(pages)
        self.unmaps += len(pages)

    def pages_in_flight(self) -> int:
        return sum(s in (PageState.MAPPING, PageState.UNMAPPING) for s in self.state)

    # ---- driver calls (lock not held) -------------------------------------------------------

    def map(self, page: int) -> None:
        """Map ``page`` in every slot, or, on failure, in none (and raise)."""
        done: list[tuple[int, int]] = []
        try:
            for offset, length in self.geo.regions(page):
                self.backend.map(offset, length)
                done.append((offset, length))
        except BackendError as e:
            self._unmap_regions(done)
            if self.owner:
                raise BackendError(f"{self.owner}: KV page {page}: {e}") from e
            raise
        except BaseException:
            self._unmap_regions(done)
            raise

    def _unmap_regions(self, regions: list[tuple[int, int]]) -> None:
        for offset, length in regions:
            self.backend.unmap(offset, length)

    def unmap(self, page: int) -> None:
        self._unmap_regions(list(self.geo.regions(page)))

    def unmap_runs(self, pages: list[int], done: Callable[[list[int]], None]) -> None:
        """Unmap ``pages`` (sorted): one call per slot for each run of consecutive pages
        where the backend takes ranges (``unmaps_ranges``), else one per slot and page;
        ``done(run)`` for every run, whether or not its unmap failed."""
        merge = getattr(self.backend, "unmaps_ranges", False)
        runs = [[p] for p in pages[:1]]
        for p in pages[1:]:
            if merge and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            try:
                for offset, length in self.geo.regions(run[0]):
                    self.backend.unmap(offset, length * len(run))
            finally:
                done(run)

    # ---- replay on other ranks --------------------------------------------------------------

    def _record(self, kind: str, page: int) -> None:
        if self._ops is not None:
            self._ops.append(PageOp(kind, page))

    def check_replay(self, op: PageOp) -> None:
        """Wait for ``op``'s page to settle; raise unless it is where the op starts from
        (under ``cond``)."""
        page = op.page
        self.wait_settled(page)
        want = PageState.UNMAPPED if op.kind == "map" else PageState.MAPPED
        if self.state[page] is not want:
            raise KvmemError(f"cannot {op.kind} KV page {page}: it is "
                             f"{self.state[page].name.lower()} on this rank (ranks "
                             "disagree about the page map)")

    def has_ops(self) -> bool:
        return bool(self._ops)

    def drain_ops(self) -> list[PageOp]:
        ops, self._ops = (self._ops or []), ([] if self._ops is not None else None)
        return ops
