"""Bring one rank up, the same way at every world size (world size 1: nobody to talk to).

1. read the model config and plan KV memory with ``kvmem.plan`` for the engine's real
   layout (tp x pp, layer partition, KV budget policy, every rank's device memory);
2. load this rank's shard: its pipeline stage's layers, its tensor-parallel slice;
3. on a GPU without an explicit KV budget, measure the rank (weights, peak activation,
   non-torch, CUDA graphs) and plan again from every rank's own measurement;
4. check this rank's own fit (its RankPlan: its layers, its KV heads, its budget);
5. agree with the other ranks on one block count, the minimum over ranks;
6. allocate this rank's KV cache (its RankPlan's slots and heads, the agreed blocks);
   an elastic KV cache instead agrees on one reservation and page size, and every rank
   maps rank 0's startup pages before it serves;
7. build the rank's model runner and capture its CUDA graphs on a GPU;
8. with offloading across processes that do not share KV, open the copy channel through
   which rank 0's tiers reach this rank's blocks.

``Peers`` is how a rank talks to the others during start-up: ``Alone`` for world size 1,
``kvmem.engine.distributed.rank_setup.GroupPeers`` over process groups. Each phase ends
with every rank telling the others whether it succeeded, so that one rank's failure
becomes the same clear error on every rank instead of a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from kvmem.engine.config import EngineConfig
from kvmem.engine.distributed.config import ParallelConfig
from kvmem.engine.distributed.errors import StartupError
from kvmem.engine.kv_cache_setup import KVCacheSetup, allocate_kv_cache, plan_kv_cache
from kvmem.engine.model_runner import ModelRunner, PageMapReplay, StageLinks
from kvmem.engine.sampler import Sampler
from kvmem.errors import ConfigError
from kvmem.plan.types import rank_label
from kvmem.spec.state_groups import engine_kv_groups, state_block_size, state_group_ids
from kvmem.units import format_bytes

if TYPE_CHECKING:
    from kvmem.engine.elastic_setup import ElasticSetup, StepGate
    from kvmem.engine.memory_profile import MemoryProfile
    from kvmem.plan import Plan
    from kvmem.spec import ModelSpec

logger = logging.getLogger("kvmem.engine")
T = TypeVar("T")
# Local CPU workers with plain KV put it in shared memory for rank 0's offload tiers;
# False sends their offload copies through the copy services instead (remote_copy.py).
SHARE_LOCAL_KV = True


@dataclass(frozen=True)
class RankContext:
    """Everything a rank needs to start, decided once by rank 0 and sent to each rank."""

    config: EngineConfig
    parallel: ParallelConfig
    max_model_len: int
    dtype: str  # torch dtype name, e.g. "float32"
    device_type: str  # "cpu" or "cuda" (a rank's device: ParallelConfig.cuda_index)
    device_index: int | None = None  # world size 1: the configured device's index
    share_kv: bool = False  # KV tensors in shared memory, mapped by the driver (offload)
    profile_only: bool = False  # `kvmem profile`: measure the rank, allocate no KV

    @property
    def measures(self) -> bool:
        """Whether the rank measures its memory: profiling, or a GPU without a KV budget."""
        return self.profile_only or (self.device_type == "cuda"
                                     and self.config.kv_cache_memory_bytes is None)

    @property
    def remote_copy(self) -> bool:
        """Offloading reaches this rank's KV through a copy service (not shared memory)."""
        return self.parallel.world_size > 1 and self.config.offload_config().enabled \
            and not self.share_kv

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            index = self.parallel.cuda_index(torch.cuda.device_count()) \
                if self.parallel.world_size > 1 else self.device_index
            return torch.device("cuda", index)
        return torch.device("cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def for_rank(self, rank: int) -> RankContext:
        return replace(self, parallel=self.parallel.for_rank(rank))


@dataclass(frozen=True)
class RankAllocation:
    """What one rank planned and allocated; rank 0 keeps every rank's."""

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


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[name]


def max_model_len_for(spec: ModelSpec, config: EngineConfig) -> int:
    """config.max_model_len checked against the model's limit, or that limit."""
    limit = spec.max_position_embeddings
    if config.max_model_len is None:
        return limit or 2048
    if limit and config.max_model_len > limit:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({limit})")
    return config.max_model_len


def rank_context(config: EngineConfig, spec: ModelSpec, parallel: ParallelConfig | None = None,
                 *, profile_only: bool = False) -> RankContext:
    """The context of rank ``parallel.rank`` (default: a world-size-1 engine) of ``config``."""
    device = resolve_device(config.device)
    parallel = parallel or ParallelConfig.from_engine_config(config)
    if (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) != \
            (config.tensor_parallel_size, config.pipeline_parallel_size):
        raise ConfigError("the parallel layout differs from the engine config's")
    if device.type == "cuda" and parallel.world_size > 1 and parallel.launcher == "local":
        parallel.for_rank(parallel.world_size - 1).cuda_index(torch.cuda.device_count())
    # local CPU workers with plain KV put it in shared memory for rank 0's offload tiers
    # (elastic pages stay private to each process)
    share_kv = SHARE_LOCAL_KV and parallel.world_size > 1 and device.type == "cpu" and \
        parallel.launcher == "local" and config.kv_memory == "plain" and not profile_only
    block_size = state_block_size(spec, config.block_size, parallel.tensor_parallel_size)
    if block_size != config.block_size:  # a page must hold a linear-attention state
        logger.info("block size raised from %d to %d tokens so that an attention page holds "
                    "a linear-attention state", config.block_size, block_size)
        config = replace(config, block_size=block_size)
    return RankContext(config, parallel, max_model_len_for(spec, config),
                       str(resolve_dtype(config.dtype, device)).removeprefix("torch."),
                       device.type, device.index, share_kv, profile_only)


class CopyChannel(Protocol):
    num_slots: int


class Peers(Protocol):
    """The other ranks of the engine, as a rank's start-up talks to them."""

    def agree(self, phase: str, fn: Callable[[], T]) -> T: ...

    def all_gather(self, obj: object) -> list[Any]: ...

    def links(self, *, hidden_size: int, dtype: torch.dtype,
              device: torch.device) -> StageLinks | None: ...

    def start_elastic(self, elastic: ElasticSetup) -> None: ...

    def page_map(self, elastic: ElasticSetup) -> PageMapReplay | None: ...

    def copy_channel(self, kv: KVCacheSetup, kv_plan: Plan) -> CopyChannel | None: ...


class Alone:
    """The peers of a world-size-1 engine: none; every phase runs as is."""

    def agree(self, phase: str, fn: Callable[[], T]) -> T:
        return fn()

    def all_gather(self, obj: object) -> list[Any]:
        return [obj]

    def links(self, **_: object) -> None:
        return None

    def start_elastic(self, elastic: ElasticSetup) -> None:
        elastic.start()  # the null page is mapped: pre-mapping may begin

    def page_map(self, elastic: ElasticSetup) -> None:
        return None

    def copy_channel(self, kv: KVCacheSetup, kv_plan: Plan) -> None:
        return None


@dataclass
class RankState:
    spec: ModelSpec
    model: torch.nn.Module
    kv_plan: Plan
    kv: KVCacheSetup
    allocations: list[RankAllocation]
    runner: ModelRunner
    elastic: ElasticSetup | None = None  # with --kv-memory elastic
    memory_profile: MemoryProfile | None = None  # measured (a GPU without a KV budget)
    copy_channel: CopyChannel | None = None  # offload across processes without shared KV
    page_ops: PageMapReplay | None = None  # a rank > 0 replaying rank 0's elastic pages


def hold_to_utilization(device: torch.device, utilization: float) -> None:
    """Cap torch's caching allocator on ``device`` at ``utilization`` of its memory.

    The KV cache is sized from measured peaks, but the allocator keeps the blocks it frees
    and, as batch shapes vary, can hold more than those peaks (on an H100 at 0.95, 0.9 GB
    more: 81.7 GB reserved of the 80.8 GB allowed). Under the cap it releases cached blocks
    and retries before it grows past the budget the KV cache was sized for.
    """
    torch.cuda.set_per_process_memory_fraction(utilization, device)


def check_rank_fit(kv_plan: Plan, rank: int, *, estimated: bool = False) -> None:
    """The fit check of one rank's own RankPlan (raises FitError naming the rank).

    ``estimated``: an explicit KV budget checked against estimated activations, CUDA graphs
    and overhead (nothing was measured). Those estimates are upper bounds calibrated on
    vLLM's profiles (gemma-3-4b-it: 9.75 GiB of activations estimated where kvmem's engine
    measures 0.75 GiB), so only what is certain refuses: the weights and the KV cache alone
    past the device's memory, or a KV budget too small for max_model_len. Past the
    estimates, the engine warns and allocates, as an explicit budget asks.
    """
    own = replace(kv_plan, ranks=[kv_plan.ranks[rank]])
    r = own.ranks[0]
    if estimated and r.over_committed and r.memory_bytes is not None:
        certain = r.weights_bytes + r.kv_budget_bytes
        if certain <= r.memory_bytes and r.need_bytes_at_max_model_len <= r.kv_budget_bytes:
            left = r.memory_bytes - certain
            logger.warning(
                "%s: the explicit KV budget of %s leaves %s of %s device memory for "
                "activations, CUDA graphs and overhead, less than the %s estimated; "
                "`kvmem profile` measures them",
                rank_label(rank, kv_plan.layout.tensor_parallel_size),
                format_bytes(r.kv_budget_bytes), format_bytes(left),
                format_bytes(r.memory_bytes),
                format_bytes(r.activation_bytes + r.cuda_graph_bytes + r.non_torch_bytes))
            return
    own.check_fit()


@dataclass
class LoadedRank:
    """A rank with its shard loaded and, where it measures, every rank's measurement."""

    spec: ModelSpec
    kv_plan: Plan
    model: torch.nn.Module
    memory_profile: MemoryProfile | None = None  # this rank's
    profiles: list[MemoryProfile] | None = None  # every rank's, in rank order


def load_rank(ctx: RankContext, peers: Peers) -> LoadedRank:
    """Steps 1-3: plan, load the shard, and measure it (then plan from the measurements)."""
    from kvmem.engine.loader import resolve_model
    from kvmem.engine.loader.dummy import initialize_dummy_weights
    from kvmem.engine.models import build_model
    from kvmem.engine.profiler import meter_for
    from kvmem.spec import spec_from_config

    config, parallel, device = ctx.config, ctx.parallel, ctx.device
    rank = parallel.rank
    files = peers.agree("reading the model", lambda: resolve_model(
        config.model, load_format=config.load_format))
    spec = spec_from_config(files.config, files.name)
    memory = None
    if device.type == "cuda" and parallel.world_size > 1:  # GPUs may differ
        memory = peers.all_gather(torch.cuda.get_device_properties(device).total_memory)

    def plan(profiles: list | None = None, partition: list[int] | None = None) -> Plan:
        return plan_kv_cache(spec, config, device=device, kv_dtype=ctx.dtype,
                             max_model_len=ctx.max_model_len, memory_bytes=memory,
                             profile=profiles, layer_partition=partition)

    kv_plan = peers.agree("planning the KV cache", plan)
    rank_plan = kv_plan.ranks[rank]
    meter = meter_for(device) if ctx.measures else None
    if meter is not None:
        meter.start()  # before the weights
        if not ctx.profile_only and device.type == "cuda":
            hold_to_utilization(device, config.gpu_memory_utilization)

    def load_shard() -> torch.nn.Module:
        layers = range(rank_plan.layers[0], rank_plan.layers[-1] + 1)
        model = build_model(files.config, dtype=ctx.torch_dtype, device=device,
                            tp_rank=parallel.tp_rank, tp_size=parallel.tensor_parallel_size,
                            layers=layers, attention_backend=config.attention_backend)
        if config.load_format == "dummy":
            initialize_dummy_weights(model, seed=config.seed)
        else:
            model.load_weights(files.weights())
        return model

    model = peers.agree("loading its weights", load_shard)
    loaded = LoadedRank(spec, kv_plan, model)
    if meter is None:
        return loaded
    loaded.memory_profile = peers.agree("measuring its memory", lambda: measure_rank(
        ctx, spec, model, rank_plan, files, meter))
    logger.info("%s: %s", parallel.describe(), loaded.memory_profile.summary())
    loaded.profiles = peers.all_gather(loaded.memory_profile)
    if not ctx.profile_only:  # each rank sized from its own measurement
        rank_profiles = [p.to_rank_profile() for p in loaded.profiles]
        partition = stage_partition(kv_plan, parallel)
        loaded.kv_plan = peers.agree("planning the KV cache from the measurements",
                                     lambda: plan(rank_profiles, partition))
    return loaded


def build_rank(ctx: RankContext, peers: Peers, steps: StepGate | None = None) -> RankState:
    """Every step: a rank ready to run the steps rank 0 schedules. ``steps``: rank 0's
    engine's step lock and loop wake, which elastic KV memory gives back at."""
    config, parallel, device = ctx.config, ctx.parallel, ctx.device
    rank = parallel.rank
    if device.type == "cpu" and not ctx.profile_only:
        from kvmem.engine.cpu_malloc import keep_freed_memory

        keep_freed_memory()
    loaded = load_rank(ctx, peers)
    spec, kv_plan, model = loaded.spec, loaded.kv_plan, loaded.model
    rank_plan = kv_plan.ranks[rank]
    memory_profile = loaded.memory_profile
    estimated = config.kv_cache_memory_bytes is not None and memory_profile is None
    peers.agree("checking its KV cache fits",
                lambda: check_rank_fit(kv_plan, rank, estimated=estimated))
    num_blocks = agree_num_blocks(peers, kv_plan, rank)
    elastic = None
    if config.kv_memory == "elastic":
        from kvmem.engine.elastic_setup import ElasticSetup

        elastic = peers.agree("sizing its elastic KV memory", lambda: ElasticSetup.for_rank(
            config, spec, kv_plan, device=device, max_model_len=ctx.max_model_len, rank=rank,
            world_size=parallel.world_size, steps=steps))
    kv = peers.agree("allocating its KV cache", lambda: allocate_kv_cache(
        spec, kv_plan, block_size=config.block_size, dtype=ctx.torch_dtype, device=device,
        rank=rank, elastic=elastic, views=elastic is None))
    if elastic is not None:
        # Not inside agree(): a rank that never arrives must fail this rank within the
        # timeout, not hold it in a collective. Views need the replayed pages (CUDA).
        peers.start_elastic(elastic)
        from kvmem.engine.kv_cache_setup import layer_views

        kv.kv_caches = layer_views(spec, rank_plan, kv.storage)
        num_blocks = kv.num_blocks
    mine = RankAllocation(
        rank=rank, pp_stage=rank_plan.pp_stage, tp_rank=rank_plan.tp_rank,
        layers=list(rank_plan.layers), kv_heads_on_rank=rank_plan.kv_heads_on_rank,
        num_slots=rank_plan.num_slots, num_blocks=num_blocks,
        rank_plan_blocks=rank_plan.num_blocks, kv_budget_bytes=rank_plan.kv_budget_bytes,
        kv_bytes_per_token=rank_plan.kv_bytes_per_token, allocated_bytes=kv.storage.nbytes)
    allocations = peers.all_gather(mine)
    page_ops = peers.page_map(elastic) if elastic is not None else None
    links = peers.links(hidden_size=int(model.config["hidden_size"]), dtype=ctx.torch_dtype,
                        device=device)
    groups = engine_kv_groups(spec)
    runner = ModelRunner(model, kv.kv_caches, num_kv_groups=len(groups),
                         block_size=config.block_size, device=device,
                         sampler=Sampler(config.seed), links=links, page_map=page_ops,
                         state_groups=tuple(state_group_ids(groups)))
    capture_graphs(runner, config, model, ctx.max_model_len, device)
    channel = peers.copy_channel(kv, kv_plan) if ctx.remote_copy else None
    return RankState(spec, model, kv_plan, kv, allocations, runner, elastic, memory_profile,
                     channel, page_ops)


def measure_rank(ctx: RankContext, spec: ModelSpec, model: torch.nn.Module, rank_plan,
                 files, meter) -> MemoryProfile:
    from kvmem.engine.profiler import LoadedModel, measure_loaded

    name = ctx.config.served_model_name or files.name
    parallel = ctx.parallel
    loaded = LoadedModel(model, spec, ctx.device, ctx.torch_dtype, ctx.max_model_len, name,
                         str(files.path), rank_plan=rank_plan, rank=parallel.rank,
                         tensor_parallel_size=parallel.tensor_parallel_size,
                         pipeline_parallel_size=parallel.pipeline_parallel_size)
    return measure_loaded(loaded, ctx.config, meter)


def capture_graphs(runner: ModelRunner, config: EngineConfig, model: torch.nn.Module,
                   max_model_len: int, device: torch.device) -> None:
    """Decode CUDA graphs on a GPU rank that runs the whole forward (world size 1)."""
    from kvmem.engine.cuda_graphs import capture_sizes
    from kvmem.engine.profiler import cuda_graphs_enabled

    if device.type == "cuda" and runner.links is None and cuda_graphs_enabled(config, model):
        runner.capture_cuda_graphs(capture_sizes(config.max_num_seqs), max_model_len)


def stage_partition(kv_plan: Plan, parallel: ParallelConfig) -> list[int]:
    """Layers per pipeline stage of ``kv_plan`` (kept when planning again)."""
    tp = parallel.tensor_parallel_size
    return [len(kv_plan.ranks[stage * tp].layers)
            for stage in range(parallel.pipeline_parallel_size)]


def agree_num_blocks(peers: Peers, kv_plan: Plan, rank: int) -> int:
    """Every rank's own block count, exchanged; the engine uses the minimum."""
    own = kv_plan.ranks[rank]
    counts = peers.all_gather(own.num_blocks if own.bytes_per_block else None)
    paged = [c for c in counts if c is not None]
    agreed = min(paged) if paged else 0
    if agreed != kv_plan.engine.num_blocks:
        raise StartupError(f"ranks disagree on the KV block count: their plans hold {counts} "
                          f"blocks but the engine plan says {kv_plan.engine.num_blocks}")
    return agreed
