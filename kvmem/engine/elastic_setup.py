"""Elastic KV memory in the engine (``--kv-memory elastic``): reservation, budget, wiring.

One process::

    steps = StepGate()                             # the engine's step lock, its loop's wake
    elastic = ElasticSetup.for_rank(config, spec, kv_plan, device=..., max_model_len=...,
                                    steps=steps)
    kv = allocate_kv_cache(..., elastic=elastic)   # an ElasticKVStorage; null page mapped
    pool = elastic.make_pool(num_groups)           # page-aware queue, hooks, capacity guard
    manager = KVCacheManager(..., pool=pool)
    elastic.start()                                # only now the pre-mapping thread

Every rank sizes its reservation from the engine's plan (all ranks hold the same plan, so
they agree on the page layout without talking); a parallel engine's ranks then run
``start(store, timeout)``, ``PageMapCoordinator.startup``, so that every rank maps the
same pages in the same order before serving. Rank and world size are
arguments from the engine's ParallelConfig; only rank 0 takes bytes from the ledger,
counting, on the CPU, every rank's pages (they are all in the host's memory; the limit
counts them too), and on a GPU its own (each GPU is its own ledger's device).

Sharing the device: the engine registers its floor (``--kv-memory-min``), ceiling
(``--kv-memory-limit``) and one request's bytes. When other engines ask it to give memory
back (they wake its pre-mapping thread), or its ceiling is lowered, the memory goes back
at a step boundary: the engine's loop, woken by that thread, runs ``apply_due`` before
its next step (an idle engine at once, a busy one after its step); an engine without a
loop (an idle ``LLM``) has the thread give back itself, under the engine's step lock.
The lock and the loop's wake-up are the engine's, given at construction (``StepGate``).
Free pages go back first, then pages holding only cached blocks, least recently used
first, evicted from the pool (demoted to a tier first, when the engine has one). If it
is still over a lowered ceiling, the scheduler preempts running requests
(``excess_blocks``) until it is under.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvmem.engine.config import EngineConfig
from kvmem.errors import ConfigError
from kvmem.memory import ElasticKVStorage, Ledger, PageMapCoordinator, reclaim
from kvmem.memory.budget import BudgetState, MemoryWait
from kvmem.memory.huge_pages import check_huge_pages
from kvmem.memory.sizing import CUDA_GRANULARITY, ElasticSizing, plan_elastic, useful_blocks
from kvmem.memory.storage import SlotShape
from kvmem.spec import ModelSpec
from kvmem.spec.state_groups import engine_kv_groups, state_blocks_per_request, state_group_ids
from kvmem.units import format_bytes

if TYPE_CHECKING:
    from kvmem.plan import Plan

logger = logging.getLogger("kvmem.engine")


def default_engine_name(config: EngineConfig) -> str:
    """The served model name (a checkpoint path's last part) and the process id."""
    name = config.served_model_name or Path(config.model_name).name or config.model_name
    return f"{name}-{os.getpid()}"


def _granularity(device: torch.device, *, huge_pages: bool, world_size: int) -> int:
    if device.type == "cuda":  # huge pages there: make_backend refuses them in one line
        return CUDA_GRANULARITY
    if huge_pages:  # the other ranks' pages are in memory files rank 0 releases
        return check_huge_pages(shared=world_size > 1, what="--kv-memory-huge-pages")
    import mmap

    return mmap.PAGESIZE


@dataclass
class StepGate:
    """The engine's step boundary as elastic memory sees it, made by the engine before
    its ranks and given to their set-up: the lock held around every step (and every
    change of request or block state), and, while an engine loop runs, how to wake it
    (``wake_loop``; None: no loop runs)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    wake_loop: Callable[[], None] | None = None


@dataclass
class ElasticSetup:
    """One rank's elastic KV cache: its sizing, then its storage once built."""

    sizing: ElasticSizing
    name: str  # the engine's name in the ledger
    rank: int
    world_size: int
    device: torch.device
    need_blocks: Callable[[int], int]  # blocks one request of n tokens holds (+ the null)
    max_model_len: int
    wait_timeout: float = 60.0
    floor_bytes: int = 0
    huge_pages: bool = False  # CPU pages of whole transparent huge pages
    # the engine's step lock and loop wake (rank 0; the other ranks never give back)
    steps: StepGate | None = None
    storage: ElasticKVStorage | None = None
    pool: Any = None  # the block pool make_pool built (its cached blocks can be evicted)
    _memory_wait: MemoryWait = field(default_factory=MemoryWait, init=False, repr=False)
    _due: BudgetState | None = field(default=None, init=False, repr=False)

    @classmethod
    def for_rank(cls, config: EngineConfig, spec: ModelSpec, kv_plan: Plan, *,
                 device: torch.device, max_model_len: int, rank: int = 0,
                 world_size: int = 1, steps: StepGate | None = None) -> ElasticSetup:
        """Rank ``rank``'s reservation, from ``kvmem.memory.sizing.plan_elastic`` over the
        engine's plan: the function ``kvmem plan --kv-memory elastic`` calls, so the
        planner and the engine agree on the blocks by construction (only the page
        granularity is the device's: 2 MiB on a GPU, the OS page on CPU, or its huge
        page with ``--kv-memory-huge-pages``). ``steps``:
        the engine's step boundary, which rank 0 gives memory back at."""
        if rank == 0 and steps is None:
            raise ConfigError("rank 0's elastic KV memory needs the engine's step lock")
        groups = spec.kv_groups()
        block_size, batched = config.block_size, config.max_num_batched_tokens
        state_groups = len(state_group_ids(engine_kv_groups(spec)))
        caching = config.enable_prefix_caching

        def need_blocks(num_tokens: int) -> int:
            states = state_groups * state_blocks_per_request(num_tokens, block_size,
                                                             prefix_caching=caching)
            return useful_blocks(groups, max_model_len=num_tokens, block_size=block_size,
                                 max_num_batched_tokens=batched, max_num_seqs=1) + states

        sizings = plan_elastic(kv_plan, spec, config.kv_memory_limit_bytes,
                               granularity=_granularity(
                                   device, huge_pages=config.kv_memory_huge_pages,
                                   world_size=world_size),
                               one_memory=device.type == "cpu")
        paged = [r.rank for r in kv_plan.ranks if r.num_slots and r.slot_page_bytes]
        sizing = sizings[paged.index(rank)]
        leader = sizings[0]  # rank 0's limit is the ledger's
        need = need_blocks(max_model_len)
        if leader.limit_blocks < need:
            raise ConfigError(
                f"the KV memory limit {format_bytes(leader.limit_bytes)} holds "
                f"{leader.limit_blocks} blocks (whole pages of {leader.blocks_per_page}) but "
                f"one request of max_model_len {max_model_len:,} needs {need} (incl. the null "
                "block); raise --kv-memory-limit or lower --max-model-len")
        name = config.engine_name or default_engine_name(config)
        return cls(sizing, name, rank, world_size, device, need_blocks, max_model_len,
                   wait_timeout=config.distributed_timeout_s,
                   floor_bytes=config.kv_memory_floor_bytes or 0,
                   huge_pages=config.kv_memory_huge_pages, steps=steps)

    @property
    def request_bytes(self) -> int:
        """Whole pages one request of max_model_len needs (the null block's included)."""
        s = self.sizing
        pages = -(-self.need_blocks(self.max_model_len) // s.blocks_per_page)
        return pages * s.ledger_page_bytes

    # -- storage -------------------------------------------------------------------------
    def build_storage(self, num_slots: int, shape: SlotShape, dtype: torch.dtype,
                      device: torch.device) -> ElasticKVStorage:
        """The rank's storage; rank 0 registers with its device's ledger first."""
        budget = None
        if self.rank == 0:
            budget = Ledger.for_device(ledger_device_name(device)).register(
                self.name, floor_bytes=self.floor_bytes, ceiling_bytes=self.sizing.limit_bytes,
                request_bytes=self.request_bytes)
        try:
            self.storage = ElasticKVStorage(
                num_slots, shape, dtype, max_blocks=self.sizing.max_blocks, device=str(device),
                budget=budget, blocks_per_page=self.sizing.blocks_per_page, rank=self.rank,
                world_size=self.world_size, wait_timeout=self.wait_timeout, start=False,
                ledger_page_bytes=self.sizing.ledger_page_bytes, huge_pages=self.huge_pages)
        except BaseException:
            if budget is not None:
                budget.close()
            raise
        s = self.sizing
        logger.info("elastic KV memory: %s reserved (%d blocks, pages of %d blocks = %s%s), "
                    "limit %s (%d blocks), ledger name %r", format_bytes(s.reserved_bytes),
                    s.max_blocks, s.blocks_per_page, format_bytes(s.page_bytes),
                    " in huge pages" if self.huge_pages else "",
                    format_bytes(s.limit_bytes), s.limit_blocks, self.name)
        return self.storage

    def make_pool(self, num_groups: int, *, enable_events: bool = True):
        """The block pool over the storage's blocks: page-aware free queue, mapping hooks and
        the shared-budget capacity guard."""
        from kvmem.cache import BlockPool

        storage = self._storage()
        self.pool = BlockPool(storage.num_blocks, num_groups, enable_events=enable_events,
                              **storage.pool_wiring())
        return self.pool

    def start(self, store: Any = None, timeout: float | None = None) -> None:
        """Start background pre-mapping; with ranks, first bring them to one page map."""
        storage = self._storage()
        if self.world_size == 1:
            storage.start(reclaim=self.reclaim, on_due=self._memory_due)
            return
        coordinator = PageMapCoordinator(store, rank=self.rank, world_size=self.world_size,
                                         timeout=timeout or self.wait_timeout)
        coordinator.startup(storage, reclaim=self.reclaim, on_due=self._memory_due)

    # -- giving memory back ----------------------------------------------------------------
    def _memory_due(self, state: BudgetState) -> None:
        """The memory thread found memory to give back (other engines asked, or the
        ceiling was lowered): wake the engine loop, which gives it back at its next step
        boundary (``apply_due``); with no loop running (an idle ``LLM``), give it back
        now, between steps, under the engine's step lock."""
        steps = self._steps()
        wake = steps.wake_loop
        if wake is not None:
            self._due = state
            wake()
            return
        with steps.lock:
            self._answer(state)

    def apply_due(self) -> None:
        """Give back what the memory thread found due (the engine loop, between steps)."""
        state, self._due = self._due, None
        if state is not None:
            self._answer(state)

    def _answer(self, state: BudgetState) -> None:
        start = time.monotonic()
        given = self._storage().answer(state)
        if given:
            logger.info("elastic KV memory: gave back %s in %.0f ms", format_bytes(given),
                        (time.monotonic() - start) * 1e3)

    def reclaim(self, nbytes: int) -> int:
        """Give about ``nbytes`` back: free pages and then pages of cached blocks only,
        least recently used first, evicted from the pool; the bytes given. Between
        steps only (under the engine's step lock)."""
        return self._storage().give_back(nbytes, evict=self._evict)

    def _evict(self, block_ids: list[int]) -> None:
        if self.pool is None:
            return
        self.pool.evict_cached(block_ids)  # a tier copies each out first
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # those copies read pages about to go

    def excess_pages(self) -> int:
        """Pages of running requests' KV above what the engine may hold now (a lowered
        ceiling): the scheduler preempts running requests until this is 0; the pages they
        free go back at the next heartbeat."""
        table = self._storage().table
        allowed = table.allowed_bytes
        if allowed is None or table.held_bytes <= allowed:
            return 0
        return max(0, table.pages_in_use() - allowed // table.page_bytes)

    def want(self, num_tokens: list[int]) -> bool:
        """Requests of these lengths (those running and those waiting for a slot) need
        their blocks: ask other engines, once for all of them, for what the device total
        keeps from them (a busy engine does not wait for memory an idle one only caches).
        Returns whether some is coming: then a running request short of blocks waits
        rather than preempting another, as long as some arrives every 5 s
        (``MemoryWait``; then the scheduler preempts as usual)."""
        storage = self._storage()
        if storage.budget is None or self.pool is None or not num_tokens:
            return False
        blocks = sum(self.need_blocks(n) - 1 for n in num_tokens)  # less the null block
        more = blocks - self.pool.usage().used
        coming = reclaim.ask_for_blocks(storage.table, storage.budget, more)
        return self._memory_wait(coming, storage.table.held_bytes)

    # -- the scheduler's view ------------------------------------------------------------
    def fits_limit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` fits under this engine's ceiling once other
        engines gave back what they hold above their floors: if so, a refusal only means
        waiting for them to free some."""
        storage = self._storage()
        cap = storage.table.attainable_bytes
        limit_blocks = self.sizing.limit_blocks if cap is None else \
            cap // self.sizing.ledger_page_bytes * self.sizing.blocks_per_page
        return self.need_blocks(num_tokens) <= limit_blocks

    def backoff(self, seconds: float = 0.01) -> None:
        """Pause a step that scheduled nothing because memory is at the shared limit."""
        time.sleep(seconds)

    def drain_ops(self) -> list:
        return self._storage().drain_ops()

    def apply_ops(self, ops: list) -> None:
        self._storage().apply_ops(ops)

    def close(self) -> None:
        """Stop pre-mapping, leave the ledger and release the reservation (idempotent)."""
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    def _steps(self) -> StepGate:
        if self.steps is None:
            raise ConfigError("this rank's elastic KV memory gives nothing back: "
                              "it has no step lock")
        return self.steps

    def _storage(self) -> ElasticKVStorage:
        if self.storage is None:
            raise ConfigError("the elastic KV storage is not built (or already closed)")
        return self.storage


def ledger_device_name(device: torch.device) -> str:
    """The device as the ledger and ``kvmem limit --device`` name it: ``cpu`` or ``cuda:N``
    (a bare ``cuda`` is the current CUDA device)."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"cuda:{index}"
    return str(device)
