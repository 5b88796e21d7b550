"""Bring one rank up, the same way on the driver and on every worker.

1. read the model config and plan KV memory with ``kvmem.plan`` for the engine's real
   layout (tp x pp, layer partition, KV budget policy, every rank's device memory);
2. load this rank's shard: its pipeline stage's layers, its tensor-parallel slice;
3. check this rank's own fit (its RankPlan: its layers, its KV heads, its budget);
4. agree with the other ranks on one block count, the minimum over ranks;
5. allocate this rank's KV cache (its RankPlan's slots and heads, the agreed blocks);
   an elastic KV cache instead agrees on one reservation and page size, and every rank
   maps rank 0's startup pages (``PageMapCoordinator``) before it serves;
6. with offloading on and KV not shared with the driver, open the copy channel
   (``kvmem.engine.distributed.remote_copy``) through which the driver's tiers reach
   every rank's blocks.

Each phase ends with every rank telling the others whether it succeeded, so that one
rank's failure becomes the same clear error on every rank instead of a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kvmem.engine.config import EngineConfig
from kvmem.engine.distributed.config import ParallelConfig
from kvmem.engine.distributed.errors import StartupError
from kvmem.engine.distributed.remote_copy import open_copy_channel
from kvmem.engine.distributed.stage_runner import StageRunner
from kvmem.engine.distributed.state import DistributedGroups
from kvmem.engine.kv_cache_setup import (
    KVCacheSetup,
    allocate_kv_cache,
    layer_views,
    plan_kv_cache,
)
from kvmem.engine.sampler import Sampler
from kvmem.errors import KvmemError
from kvmem.tiers.blocks import BlockCopier

logger = logging.getLogger("kvmem.engine.distributed")
T = TypeVar("T")


@dataclass(frozen=True)
class RankContext:
    """Everything a rank needs to start, decided once by the driver and sent to each rank."""

    config: EngineConfig
    parallel: ParallelConfig
    max_model_len: int
    dtype: str  # torch dtype name, e.g. "float32"
    device_type: str  # "cpu" or "cuda" (a CUDA rank uses device cuda:local_rank)
    share_kv: bool = False  # KV tensors in shared memory, mapped by the driver (offload)

    @property
    def remote_copy(self) -> bool:
        """Offloading reaches the workers' KV through copy services (not shared memory)."""
        return self.config.offload_config().enabled and not self.share_kv

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.parallel.local_rank)
        return torch.device("cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def for_rank(self, rank: int) -> RankContext:
        return replace(self, parallel=self.parallel.for_rank(rank))


@dataclass(frozen=True)
class RankAllocation:
    """What one rank planned and allocated; the driver keeps every rank's."""

    rank: int
    pp_stage: int
    tp_rank: int
    layers: list[int]
    kv_heads_on_rank: int
    num_slots: int
    num_blocks: int  # allocated: the engine's agreed block count
    rank_plan_blocks: int  # what this rank's own budget holds
    kv_budget_bytes: int
    kv_bytes_per_token: int
    allocated_bytes: int


@dataclass
class RankState:
    spec: Any  # kvmem.spec.ModelSpec
    model: torch.nn.Module
    kv_plan: Any  # kvmem.plan.Plan
    kv: KVCacheSetup
    allocations: list[RankAllocation]
    runner: StageRunner
    elastic: Any = None  # an ElasticSetup with --kv-memory elastic
    copy_channel: Any = None  # a remote_copy.CopyChannel when ``ctx.remote_copy``
    page_ops: Any = None  # a worker's OrderedPageOps with --kv-memory elastic


def agree(groups: DistributedGroups, phase: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if any rank fails, every rank raises that rank's error."""
    result, failure = None, None
    try:
        result = fn()
    except Exception as e:  # reported to every rank below, then raised there
        failure = (type(e).__name__, str(e) or repr(e), isinstance(e, KvmemError))
        if not isinstance(e, KvmemError):
            logger.exception("%s failed while %s", groups.parallel.describe(), phase)
    failures: list[Any] = [None] * groups.parallel.world_size
    dist.all_gather_object(failures, failure, group=groups.startup)
    for rank, item in enumerate(failures):
        if item is None:
            continue
        name, message, user_error = item
        if name == "FitError":
            from kvmem.plan import FitError

            raise FitError(message)  # already names the rank
        kind = "" if user_error else f"{name}: "
        raise StartupError(f"{groups.parallel.describe(rank)} failed while {phase}: "
                           f"{kind}{message}")
    return result


def check_rank_fit(kv_plan, rank: int) -> None:
    """The fit check of one rank's own RankPlan (raises FitError naming the rank)."""
    replace(kv_plan, ranks=[kv_plan.ranks[rank]]).check_fit()


def setup_rank(ctx: RankContext, groups: DistributedGroups) -> RankState:
    from kvmem.engine.loader import resolve_model
    from kvmem.engine.models import build_model
    from kvmem.spec import spec_from_config

    config, parallel, device = ctx.config, ctx.parallel, ctx.device
    rank = parallel.rank
    files = agree(groups, "reading the model", lambda: resolve_model(config.model))
    spec = spec_from_config(files.config, files.name)
    memory = None
    if device.type == "cuda":  # GPUs may differ: every rank's memory goes into the plan
        memory = [None] * parallel.world_size
        own = torch.cuda.get_device_properties(device).total_memory
        dist.all_gather_object(memory, own, group=groups.startup)
    kv_plan = agree(groups, "planning the KV cache", lambda: plan_kv_cache(
        spec, config, device=device, kv_dtype=ctx.dtype, max_model_len=ctx.max_model_len,
        memory_bytes=memory))
    rank_plan = kv_plan.ranks[rank]

    def load_shard() -> torch.nn.Module:
        layers = range(rank_plan.layers[0], rank_plan.layers[-1] + 1)
        model = build_model(files.config, dtype=ctx.torch_dtype, device=device,
                            tp_rank=parallel.tp_rank, tp_size=parallel.tensor_parallel_size,
                            layers=layers, attention_backend=config.attention_backend)
        model.load_weights(files.weights())
        return model

    model = agree(groups, "loading its weights", load_shard)
    agree(groups, "checking its KV cache fits", lambda: check_rank_fit(kv_plan, rank))
    num_blocks = agree_num_blocks(groups, kv_plan)
    elastic = None
    if config.kv_memory == "elastic":
        elastic = agree(groups, "sizing its elastic KV memory",
                        lambda: size_elastic(ctx, groups, spec, kv_plan))
    kv = agree(groups, "allocating its KV cache", lambda: allocate_kv_cache(
        spec, kv_plan, block_size=config.block_size, dtype=ctx.torch_dtype, device=device,
        rank=rank, elastic=elastic, views=elastic is None))
    if elastic is not None:
        # Not inside agree(): a rank that never arrives must fail this rank within the
        # timeout, not hold it in a collective. Views need the replayed pages (CUDA).
        elastic.start(groups.store, timeout=parallel.timeout_s)
        kv.kv_caches = layer_views(spec, rank_plan, kv.storage)
        num_blocks = kv.num_blocks
    mine = RankAllocation(
        rank=rank, pp_stage=rank_plan.pp_stage, tp_rank=rank_plan.tp_rank,
        layers=list(rank_plan.layers), kv_heads_on_rank=rank_plan.kv_heads_on_rank,
        num_slots=rank_plan.num_slots, num_blocks=num_blocks,
        rank_plan_blocks=rank_plan.num_blocks, kv_budget_bytes=rank_plan.kv_budget_bytes,
        kv_bytes_per_token=rank_plan.kv_bytes_per_token, allocated_bytes=kv.storage.nbytes)
    allocations: list[Any] = [None] * parallel.world_size
    dist.all_gather_object(allocations, mine, group=groups.startup)
    page_ops = None
    if elastic is not None and rank != 0:
        from kvmem.engine.distributed.page_ops import OrderedPageOps

        page_ops = OrderedPageOps(elastic, parallel.timeout_s)
    runner = StageRunner(model, kv.kv_caches, groups, block_size=config.block_size,
                         device=device, dtype=ctx.torch_dtype, sampler=Sampler(config.seed),
                         page_map=page_ops)
    channel = open_copy_channel(groups, local_copier(kv, kv_plan, rank)) \
        if ctx.remote_copy else None
    return RankState(spec, model, kv_plan, kv, allocations, runner, elastic, channel, page_ops)


def local_copier(kv: KVCacheSetup, kv_plan, rank: int) -> BlockCopier:
    """A block copier over this rank's own KV slots."""
    return BlockCopier(kv.storage, kv_plan.ranks[rank].num_slots)


def size_elastic(ctx: RankContext, groups: DistributedGroups, spec, kv_plan):
    """This rank's elastic KV sizing, agreed with every rank (one reservation, one page)."""
    from kvmem.engine.elastic_setup import ElasticSetup

    def exchange(obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * groups.parallel.world_size
        dist.all_gather_object(gathered, obj, group=groups.startup)
        return gathered

    return ElasticSetup.for_rank(ctx.config, spec, kv_plan, device=ctx.device,
                                 max_model_len=ctx.max_model_len, rank=groups.parallel.rank,
                                 world_size=groups.parallel.world_size, exchange=exchange)


def agree_num_blocks(groups: DistributedGroups, kv_plan) -> int:
    """Every rank's own block count, exchanged; the engine uses the minimum."""
    own = kv_plan.ranks[groups.parallel.rank]
    counts: list[Any] = [None] * groups.parallel.world_size
    dist.all_gather_object(counts, own.num_blocks if own.bytes_per_block else None,
                           group=groups.startup)
    paged = [c for c in counts if c is not None]
    agreed = min(paged) if paged else 0
    if agreed != kv_plan.engine.num_blocks:
        raise StartupError(f"ranks disagree on the KV block count: their plans hold {counts} "
                           f"blocks but the engine plan says {kv_plan.engine.num_blocks}")
    return agreed
