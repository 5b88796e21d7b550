"""Elastic KV memory in the engine (``--kv-memory elastic``): reservation, budget, wiring.

One process::

    elastic = ElasticSetup.for_rank(config, spec, kv_plan, device=..., max_model_len=...)
    kv = allocate_kv_cache(..., elastic=elastic)   # an ElasticKVStorage; null page mapped
    pool = elastic.make_pool(num_groups)           # page-aware queue, hooks, capacity guard
    manager = KVCacheManager(..., pool=pool)
    elastic.start()                                # only now the pre-mapping thread

A parallel engine's ranks first agree on the page layout (``exchange``: an all-gather over
the ranks), then ``start(store, timeout)`` runs ``PageMapCoordinator.startup`` so that
every rank maps the same pages in the same order before serving. Rank and world size are
arguments from the engine's ParallelConfig; only rank 0 takes bytes from the ledger.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from math import lcm
from pathlib import Path
from typing import Any

import torch

from kvmem.engine.config import EngineConfig
from kvmem.errors import ConfigError
from kvmem.memory import ElasticKVStorage, Ledger, PageMapCoordinator
from kvmem.memory.pages import blocks_per_page_for
from kvmem.memory.sizing import CUDA_GRANULARITY, ElasticSizing, elastic_sizing, useful_blocks
from kvmem.memory.storage import SlotShape
from kvmem.spec import ModelSpec
from kvmem.units import format_bytes

logger = logging.getLogger("kvmem.engine")

Exchange = Callable[[Any], list[Any]]  # all-gather of one object per rank, in rank order


def default_engine_name(config: EngineConfig) -> str:
    """The served model name (a checkpoint path's last part) and the process id."""
    name = config.served_model_name or Path(config.model_name).name or config.model_name
    return f"{name}-{os.getpid()}"


def _granularity(device: torch.device) -> int:
    if device.type == "cuda":
        return CUDA_GRANULARITY
    import mmap

    return mmap.PAGESIZE


def _device_free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


@dataclass
class ElasticSetup:
    """One rank's elastic KV cache: its sizing, then its storage once built."""

    sizing: ElasticSizing
    name: str  # the engine's name in the ledger
    rank: int
    world_size: int
    device: torch.device
    need_blocks: Callable[[int], int]  # blocks one request of n tokens holds (+ the null)
    wait_timeout: float = 60.0
    storage: ElasticKVStorage | None = None

    @classmethod
    def for_rank(cls, config: EngineConfig, spec: ModelSpec, kv_plan, *, device: torch.device,
                 max_model_len: int, rank: int = 0, world_size: int = 1,
                 exchange: Exchange | None = None) -> ElasticSetup:
        """Size rank ``rank``'s reservation; a parallel engine passes its all-gather."""
        own = kv_plan.ranks[rank]
        groups = spec.kv_groups()
        block_size, batched = config.block_size, config.max_num_batched_tokens

        def need_blocks(num_tokens: int) -> int:
            return useful_blocks(groups, max_model_len=num_tokens, block_size=block_size,
                                 max_num_batched_tokens=batched, max_num_seqs=1)

        useful = useful_blocks(groups, max_model_len=max_model_len, block_size=block_size,
                               max_num_batched_tokens=batched, max_num_seqs=config.max_num_seqs)
        granularity = _granularity(device)
        mine = (own.num_slots, own.slot_page_bytes,
                blocks_per_page_for(own.slot_page_bytes, granularity),
                _device_free_bytes(device) // max(1, own.bytes_per_block))
        ranks = exchange(mine) if exchange is not None else [mine]
        k = lcm(*(r[2] for r in ranks))
        limit = config.kv_memory_limit_bytes or kv_plan.ranks[0].kv_budget_bytes
        # Rank 0's sizing decides the reservation of every rank (its limit is the ledger's).
        leader = elastic_sizing(num_slots=ranks[0][0], block_slot_bytes=ranks[0][1],
                                limit_bytes=limit, device_blocks=min(r[3] for r in ranks),
                                useful=useful, granularity=granularity, blocks_per_page=k)
        sizing = leader if rank == 0 else elastic_sizing(
            num_slots=own.num_slots, block_slot_bytes=own.slot_page_bytes, limit_bytes=limit,
            device_blocks=None, useful=useful, granularity=granularity, blocks_per_page=k,
            max_blocks=leader.max_blocks)
        need = need_blocks(max_model_len)
        if leader.limit_blocks < need:
            raise ConfigError(
                f"the KV memory limit {format_bytes(limit)} holds {leader.limit_blocks} blocks "
                f"(whole pages of {leader.blocks_per_page}) but one request of max_model_len "
                f"{max_model_len:,} needs {need} (incl. the null block); raise "
                "--kv-memory-limit or lower --max-model-len")
        name = config.engine_name or default_engine_name(config)
        return cls(sizing, name, rank, world_size, device, need_blocks,
                   wait_timeout=config.distributed_timeout_s)

    # -- storage -------------------------------------------------------------------------
    def build_storage(self, num_slots: int, shape: SlotShape, dtype: torch.dtype,
                      device: torch.device) -> ElasticKVStorage:
        """The rank's storage; rank 0 registers with its device's ledger first."""
        budget = None
        if self.rank == 0:
            budget = Ledger.for_device(str(device)).register(
                self.name, limit_bytes=self.sizing.limit_bytes)
        try:
            self.storage = ElasticKVStorage(
                num_slots, shape, dtype, max_blocks=self.sizing.max_blocks, device=str(device),
                budget=budget, blocks_per_page=self.sizing.blocks_per_page, rank=self.rank,
                world_size=self.world_size, wait_timeout=self.wait_timeout, start=False)
        except BaseException:
            if budget is not None:
                budget.close()
            raise
        s = self.sizing
        logger.info("elastic KV memory: %s reserved (%d blocks, pages of %d blocks = %s), "
                    "limit %s (%d blocks), ledger name %r", format_bytes(s.reserved_bytes),
                    s.max_blocks, s.blocks_per_page, format_bytes(s.page_bytes),
                    format_bytes(s.limit_bytes), s.limit_blocks, self.name)
        return self.storage

    def make_pool(self, num_groups: int, *, enable_events: bool = True):
        """The block pool over the storage's blocks: page-aware free queue, mapping hooks and
        the shared-budget capacity guard."""
        from kvmem.cache import BlockPool

        storage = self._storage()
        pool = BlockPool(storage.num_blocks, num_groups, enable_events=enable_events,
                         free_queue=storage.free_queue())
        storage.attach(pool)
        return pool

    def start(self, store: Any = None, timeout: float | None = None) -> None:
        """Start background pre-mapping; with ranks, first bring them to one page map."""
        storage = self._storage()
        if self.world_size == 1:
            storage.start()
            return
        coordinator = PageMapCoordinator(store, rank=self.rank, world_size=self.world_size,
                                         timeout=timeout or self.wait_timeout)
        coordinator.startup(storage)

    # -- the scheduler's view ------------------------------------------------------------
    def fits_limit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` fits under this engine's limit when no other
        engine holds memory: if so, a refusal only means waiting for them to free some."""
        storage = self._storage()
        allowed = storage.table.allowed_bytes
        limit_blocks = self.sizing.limit_blocks if allowed is None else \
            allowed // self.sizing.page_bytes * self.sizing.blocks_per_page
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

    def _storage(self) -> ElasticKVStorage:
        if self.storage is None:
            raise ConfigError("the elastic KV storage is not built (or already closed)")
        return self.storage
