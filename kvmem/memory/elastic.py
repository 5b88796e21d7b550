"""``ElasticKVStorage``: KV slot tensors over a reserved virtual range, backed by physical
pages only where blocks hold live KV.

The reservation is sized for the largest pool the device could hold (``max_blocks``);
the block manager sees all of those blocks, and the shared budget decides how many may
be live at once (``capacity_guard``). A block pool takes it all at construction::

    storage = ElasticKVStorage(num_slots, shape, dtype, max_blocks=n, device="cuda:0",
                               budget=Ledger.for_device("cuda:0").register("llama"))
    pool = BlockPool(storage.num_blocks, num_groups, **storage.pool_wiring())

Startup order: the null block's page is mapped in the constructor, synchronously; the
pre-mapping thread starts only in ``start()``.

Sharing the device: the pre-mapping thread's heartbeat reads what the engine may hold and
what other engines ask it to give back (``kvmem.memory.sharing``); ``give_back`` then
unmaps its free pages and, through the ``reclaim`` callable ``start`` was given (the
engine's, which evicts cached blocks from its prefix cache, demoting them to a tier
first, under its step lock), pages that hold only cached blocks, least recently used
first, never below the engine's floor. With tensor parallelism, rank 0 decides
every mapping and the other ranks replay its decisions (``drain_ops`` / ``apply_ops``,
or ``PageMapCoordinator`` at startup); rank and world size are constructor arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmem.cache.results import NULL_BLOCK_ID as NULL_BLOCK
from kvmem.errors import ConfigError
from kvmem.memory import reclaim
from kvmem.memory.backends import PageBackend, make_backend
from kvmem.memory.budget import BudgetState, EngineBudget
from kvmem.memory.faults import with_injected_faults
from kvmem.memory.free_queue import PageAwareFreeQueue
from kvmem.memory.page_table import PageOp, PageTable
from kvmem.memory.pages import PageGeometry
from kvmem.memory.premap import PremapThread
from kvmem.memory.rank_files import RankFile, RankFiles
from kvmem.memory.storage import SlotShape

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ElasticStats:
    """The storage's figures; bytes as its ledger counts them (``PageTable.page_bytes``):
    this rank's, or those of every rank of an engine that keeps its KV in one host's
    memory."""

    reserved_bytes: int  # virtual range
    mapped_bytes: int  # physical pages mapped (or being mapped/unmapped)
    held_bytes: int  # mapped plus budget taken for pages about to be mapped
    used_bytes: int  # live blocks
    page_bytes: int
    mapped_pages: int
    live_blocks: int
    free_blocks: int
    maps: int
    unmaps: int
    limit_bytes: int | None  # the most it may hold now (ceiling and device total)
    cached_blocks: int = 0
    cached_bytes: int = 0
    live_bytes: int = 0  # blocks running requests hold (cached-free ones excluded)
    floor_bytes: int = 0
    ceiling_bytes: int | None = None
    reclaimed_bytes: int = 0  # given back to other engines
    reclaims: int = 0


class ElasticKVStorage:
    def __init__(self, num_slots: int, shape: SlotShape, dtype: torch.dtype, *, max_blocks: int,
                 device: str = "cpu", backend: PageBackend | None = None,
                 budget: EngineBudget | None = None, reserve_pages: int = 2,
                 blocks_per_page: int | None = None, min_page_bytes: int = 0,
                 rank: int = 0, world_size: int = 1, wait_timeout: float = 30.0,
                 start: bool = True, ledger_page_bytes: int | None = None,
                 huge_pages: bool = False) -> None:
        import torch

        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
        if reserve_pages < 0:
            raise ConfigError("reserve_pages must be >= 0")
        self.rank, self.world_size = rank, world_size
        self.shape, self.dtype, self.device = shape, dtype, device
        elem = torch.empty((), dtype=dtype).element_size()
        if backend is None:  # another rank's pages in a file rank 0 can release
            backend = make_backend(device, shared=rank > 0, huge_pages=huge_pages)
        self._memory_file = getattr(backend, "memory_file", None)
        self.backend = with_injected_faults(backend, rank)
        self.geometry = PageGeometry.build(
            num_slots=num_slots, block_slot_bytes=shape.elements_per_block * elem,
            max_blocks=max_blocks, granularity=self.backend.granularity,
            min_page_bytes=min_page_bytes, blocks_per_page=blocks_per_page)
        self.num_blocks = self.geometry.num_blocks
        self.budget = budget if rank == 0 else None  # rank 0 speaks for the engine
        self.table = PageTable(self.geometry, self.backend, self.budget,
                               reserve_pages=reserve_pages, wait_timeout=wait_timeout,
                               record_ops=world_size > 1 and rank == 0,  # others replay
                               owner=f"rank {rank} of {world_size}",
                               ledger_page_bytes=ledger_page_bytes)
        self.backend.reserve(self.geometry.reserved_bytes)
        if rank == 0:
            # Before any background work exists: the null block's page, synchronously.
            self.table.map_now(self.geometry.page_of(NULL_BLOCK))
            self.table.pin(NULL_BLOCK)
            self.table.remove_free(NULL_BLOCK)  # the pool keeps the null block out of its queue
        self._slots: list[torch.Tensor] | None = None
        self.ranks = RankFiles()  # rank 0: the other ranks' memory files, once connected
        self._premap: PremapThread | None = None
        self._reclaim: Callable[[int], int] = self.give_back
        self._on_due: Callable[[BudgetState], None] = self.answer
        self._answers_later = False  # on_due hands answers to the engine's own thread
        self._owed = False  # an answer handed to the engine (on_due), not yet given
        self._woken_meanwhile = False  # a wake-up came while it was owed
        if start and world_size == 1:
            self.start()

    # ---- KVStorage --------------------------------------------------------------------------

    def slot_tensor(self, slot: int) -> torch.Tensor:
        if self._slots is None:  # views are made once the null page is mapped on this rank
            geo, s = self.geometry, self.shape
            self._slots = [
                self.backend.tensor(i * geo.slot_bytes, geo.slot_bytes).view(self.dtype)
                .view(self.num_blocks, s.num_kv, s.block_size, s.num_heads, s.head_dim)
                for i in range(geo.num_slots)]
        return self._slots[slot]

    # ---- block manager wiring ---------------------------------------------------------------

    def free_queue(self) -> PageAwareFreeQueue:
        return PageAwareFreeQueue(self.table)

    def capacity_guard(self, n: int) -> bool:
        return self.table.can_allocate(n)

    def on_blocks_allocated(self, block_ids: list[int]) -> None:
        self.table.on_blocks_allocated(block_ids)

    def on_blocks_released(self, block_ids: list[int]) -> None:
        self.table.on_blocks_released(block_ids)

    def pool_wiring(self) -> dict[str, Any]:
        """``BlockPool`` constructor arguments: the page-aware free queue, the mapping
        hooks and the shared-budget guard."""
        return {"free_queue": self.free_queue(), "capacity_guard": self.capacity_guard,
                "listeners": [self]}

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, reclaim: Callable[[int], int] | None = None,
              on_due: Callable[[BudgetState], None] | None = None) -> None:
        """Start the pre-mapping thread (rank 0 only; other ranks replay rank 0's ops).
        ``reclaim(nbytes) -> bytes given``: how the engine gives memory back (default
        ``give_back`` without evicting anything). ``on_due(state)``: called by the
        thread when a heartbeat finds memory to give back; the engine then ``answer``s
        at a step boundary (default: the thread answers at once)."""
        if self.rank != 0 or self._premap is not None:
            return
        self._reclaim = reclaim or self.give_back
        self._on_due = on_due or self.answer
        self._answers_later = on_due is not None
        self._premap = premap = PremapThread(self.table, heartbeat=self._heartbeat)
        # woken by the engines that ask it for memory; where none can wake it, it polls
        if self.budget is not None and not self.budget.listen(self._wake):
            premap.watch = self._watch
        premap.start()

    def settle(self, timeout: float = 10.0) -> None:
        """Finish pending pre-mapping and trimming, and have the ledger count what is left
        (tests and benchmarks)."""
        if self.rank != 0:
            return
        if self._premap is None:
            while self.table.maintain_once():
                pass
        else:
            self._premap.settle(timeout)
        if self.budget is not None:
            self.budget.flush(timeout)

    def _heartbeat(self) -> None:
        if self.budget is None:
            return
        t = self.table
        state = self.budget.report(*t.usage_bytes())
        with t.cond:
            t.cond.notify_all()  # the caps it read (the budget keeps them) may free work
        self._hand_over(state)

    def _hand_over(self, state: BudgetState) -> bool:
        """Give back what ``state`` finds due, or hand it to the engine (``on_due``);
        whether anything was due."""
        if reclaim.due(self.table, state) <= 0:
            return False
        if self._answers_later:
            with self.table.cond:
                self._owed = True
        self._on_due(state)
        return True

    def _wake(self) -> None:
        """Another engine asked, or a limit changed. What is due is read from the ledger
        here, on the wake-up's thread, and handed over at once: a read, neither a ledger
        write nor a hop to the pre-mapping thread before the answer. Anything else (a
        raised limit, which may let pre-mapping go on) is the heartbeat's, now.

        While an answer handed to the engine is on its way, the next look comes once that
        answer is written instead: the asker wakes this engine at each of its steps, and
        a heartbeat meanwhile would only write the ledger beside the answer, which waits
        for its lock."""
        premap, budget = self._premap, self.budget
        if premap is None or budget is None:
            return
        with self.table.cond:
            if self._owed:
                self._woken_meanwhile = True
                return
        if not self._hand_over(budget.peek()):
            premap.wake()

    def answer(self, state: BudgetState) -> int:
        """Give back what the heartbeat that read ``state`` found due, and answer the
        ledger (``reclaim.answer``); the bytes given."""
        if self.budget is None:
            return 0
        try:
            return reclaim.answer(self.table, self.budget, state, self._reclaim)
        finally:
            with self.table.cond:
                woken, self._owed, self._woken_meanwhile = self._woken_meanwhile, False, False
            if woken and self._premap is not None:
                self._premap.wake()  # what was asked meanwhile is read now

    def _watch(self) -> bool:
        """Whether an ask to give back, or a lowered limit, waits in the ledger."""
        assert self.budget is not None
        state = self.budget.peek()
        return state.reclaim_bytes > 0 or (state.allowed_bytes is not None
                                           and self.table.held_bytes > state.allowed_bytes)

    def give_back(self, nbytes: int, evict: Callable[[list[int]], None] | None = None) -> int:
        """Give about ``nbytes`` back (``reclaim.give_back``: free pages, then, with
        ``evict``, pages of cached blocks only); the bytes released to the ledger."""
        floor = self.budget.floor_bytes if self.budget is not None else 0
        return reclaim.give_back(self.table, nbytes, floor, evict)

    def rank_file(self) -> RankFile | None:
        """This rank's memory file and page layout, for rank 0 to release its pages in
        (None: its pages are in no such file, e.g. on a GPU)."""
        if self._memory_file is None:
            return None
        geo = self.geometry
        return RankFile(self.rank, self._memory_file(), self.backend.granularity,
                        geo.num_slots, geo.slot_bytes, geo.page_slot_bytes)

    def connect_ranks(self, files: list[RankFile]) -> bool:
        """Rank 0: release the other ranks' pages in their files from now on, as it
        unmaps its own; whether it does."""
        if self.rank != 0 or not files or not self.ranks.connect(files):
            return False
        self.table.on_unmapped = self.ranks.release
        return True

    def drain_ops(self) -> list[PageOp]:
        return self.table.drain_ops()

    def apply_ops(self, ops: list[PageOp]) -> None:
        self.table.apply_ops(ops)

    @property
    def nbytes(self) -> int:
        """Physical KV bytes mapped now on this rank (the reservation is virtual)."""
        return self.table.mapped_pages * self.geometry.page_bytes

    def stats(self) -> ElasticStats:
        t, geo, b = self.table, self.geometry, self.budget
        with t.cond:
            live_bytes, cached_bytes = t.usage_bytes()
            return ElasticStats(
                reserved_bytes=geo.num_pages * t.page_bytes,
                mapped_bytes=t.mapped_pages * t.page_bytes, held_bytes=t.held_bytes,
                used_bytes=t.pages.live_blocks * t.block_bytes, page_bytes=t.page_bytes,
                mapped_pages=t.mapped_pages,
                live_blocks=t.pages.live_blocks, free_blocks=t.num_free, maps=t.pages.maps,
                unmaps=t.pages.unmaps, limit_bytes=t.allowed_bytes, cached_blocks=len(t.cached),
                cached_bytes=cached_bytes, live_bytes=live_bytes,
                floor_bytes=b.floor_bytes if b is not None else 0,
                ceiling_bytes=b.ceiling_bytes if b is not None else None,
                reclaimed_bytes=b.reclaimed_bytes if b is not None else 0,
                reclaims=b.reclaims if b is not None else 0)

    def close(self) -> None:
        if self._premap is not None:
            self._premap.stop()
            self._premap = None
        if self.budget is not None:
            self.budget.close()
            self.budget = None
        self.table.on_unmapped = None
        self.ranks.close()
        self._slots = None
        self.backend.close()

    def __enter__(self) -> ElasticKVStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
