"""``plan()``: the one function that sizes KV memory, per rank and for the engine.

For each rank: memory budget (ceil(total x gpu_memory_utilization)), weights, peak
activation, CUDA graphs and non-torch overhead (measured via RankProfile, else estimated),
what is left for KV, the KV budget the policy gives it, and the blocks and tokens that
budget holds. The engine uses the minimum block count over ranks.

KV budget policies:
- ``uniform``: every rank uses all it has (or the same kv_cache_memory_bytes), as vLLM does;
- ``proportional``: one tensor-parallel column's KV bytes split across its pipeline stages
  in proportion to each stage's bytes per block, so every stage holds the same number of
  blocks. The column's bytes are a stated kv_cache_memory_bytes (so no rank gets more than
  the stated per-GPU value), else the ranks' pooled capacities;
- ``optimal``: the layer partition (when not given) and per-rank budgets that maximise the
  engine's blocks while no rank exceeds its real memory or a stated kv_cache_memory_bytes;
  each rank gets exactly what those blocks need and the rest stays free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil
from pathlib import Path

from kvmem.errors import ConfigError
from kvmem.plan import estimates
from kvmem.plan.alternatives import alternatives
from kvmem.plan.geometry import Geometry, KVGeometry, StageKV
from kvmem.plan.partition import (
    best_partition,
    even_partition,
    format_partition,
    greedy_partition,
    partition_fits,
    stage_layers,
    validate_partition,
)
from kvmem.plan.types import (
    EnginePlan,
    EngineSettings,
    Layout,
    Plan,
    RankPlan,
    RankProfile,
)
from kvmem.plan.validate import check_layout, check_settings, rank_memory, rank_profiles
from kvmem.plan.vllm_release import VllmRelease
from kvmem.plan.vllm_rules import VllmGeometry
from kvmem.spec import ModelSpec, dtype_bytes
from kvmem.spec.speculative import speculative_spec
from kvmem.spec.weights import weight_breakdown


def plan(spec: ModelSpec, layout: Layout, settings: EngineSettings, policy: str = "uniform",
         profile: list[RankProfile] | None = None,
         checkpoint_dir: str | Path | None = None, suggest: bool = True) -> Plan:
    """Plan KV memory for ``spec`` on ``layout`` with ``settings`` (see the module doc).

    When the plan does not fit and ``suggest`` is set, ``Plan.alternatives`` lists layouts,
    dtypes and policies that do, each planned the same way (kvmem.plan.alternatives)."""
    result = _Planner(spec, layout, settings, policy, profile, checkpoint_dir).run()
    if suggest and not result.engine.fits:
        def planner(s: ModelSpec, lay: Layout, st: EngineSettings, pol: str) -> Plan:
            same = s is spec and lay.world_size == layout.world_size
            return _Planner(s, lay, st, pol, profile if same else None,
                            checkpoint_dir if s is spec else None).run()

        result.alternatives = alternatives(planner, spec, result, policy,
                                           profiled=bool(profile))
    return result


def engine_geometry(spec: ModelSpec, tp: int, pp: int, settings: EngineSettings,
                    kv_dtype: str) -> Geometry:
    """The rules the engine sizes its KV cache by: kvmem's own, or vLLM's release
    ``settings.vllm_version``."""
    args = (spec, tp, dtype_bytes(kv_dtype), dtype_bytes(spec.dtype), settings.block_size,
            settings.max_num_batched_tokens)
    if settings.vllm_version is None:
        return KVGeometry(*args, prefix_caching=settings.enable_prefix_caching)
    return VllmGeometry(*args, release=VllmRelease.parse(settings.vllm_version), pp=pp,
                        device=settings.device, hybrid=settings.hybrid_kv_cache_manager,
                        max_concurrent_batches=settings.max_concurrent_batches,
                        prefix_caching=settings.enable_prefix_caching,
                        mamba_cache_dtype=settings.mamba_cache_dtype,
                        mamba_ssm_cache_dtype=settings.mamba_ssm_cache_dtype,
                        cpu_avx512_bf16=settings.cpu_avx512_bf16,
                        replayssm_buffer_len=settings.replayssm_buffer_len,
                        mamba_backend=settings.mamba_backend, cpu_amx=settings.cpu_amx,
                        attention_backend=settings.attention_backend,
                        gpu_arch=settings.gpu_arch,
                        backend_block_size=settings.backend_block_size)


def _with_draft(spec: ModelSpec, settings: EngineSettings) -> ModelSpec:
    """The model with the speculative draft ``settings.speculative_config`` names; only
    under vLLM's rules (kvmem's engine runs no draft)."""
    if settings.speculative_config is None:
        return spec
    if settings.vllm_version is None:
        raise ConfigError("--speculative-config: kvmem's engine runs no speculative draft; "
                          "plan it under vLLM's rules (--vllm-version)")
    return speculative_spec(spec, settings.speculative_config)


def _with_batch_defaults(settings: EngineSettings, layout: Layout,
                         profile: list[RankProfile] | None) -> EngineSettings:
    """Settings with vLLM's per-GPU batch defaults for the limits not given (rank 0's GPU)."""
    if settings.max_num_seqs is not None and settings.max_num_batched_tokens is not None:
        return settings
    try:
        memory = profile[0].total_bytes if profile else rank_memory(layout)[0]
    except (ConfigError, IndexError, AttributeError):  # reported by the checks that follow
        memory = None
    batched, seqs = estimates.vllm_batch_defaults(memory, layout.gpus[0] if layout.gpus else None)
    return replace(settings,
                   max_num_seqs=seqs if settings.max_num_seqs is None else settings.max_num_seqs,
                   max_num_batched_tokens=(batched if settings.max_num_batched_tokens is None
                                           else settings.max_num_batched_tokens))


@dataclass(frozen=True)
class _NonKV:
    weights: int
    activation: int
    cuda_graphs: int
    non_torch: int

    @property
    def total(self) -> int:
        return self.weights + self.activation + self.cuda_graphs + self.non_torch


class _Planner:
    def __init__(self, spec: ModelSpec, layout: Layout, settings: EngineSettings, policy: str,
                 profile: list[RankProfile] | None, checkpoint_dir: str | Path | None) -> None:
        check_layout(spec, layout)
        if layout.layer_partition is not None:  # before memory: the layout error comes first
            validate_partition(layout.layer_partition, spec.num_layers,
                               layout.pipeline_parallel_size)
        settings = _with_batch_defaults(settings, layout, profile)
        spec = _with_draft(spec, settings)
        self.kv_dtype, self.max_model_len = check_settings(spec, settings, policy)
        self.spec, self.layout, self.settings, self.policy = spec, layout, settings, policy
        self.tp, self.pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
        self.world = self.tp * self.pp
        self.profiles = rank_profiles(profile, self.world)
        self.memory = [p.total_bytes if p else m
                       for p, m in zip(self.profiles, rank_memory(layout), strict=True)]
        if settings.kv_cache_memory_bytes is None and None in self.memory:
            raise ConfigError("give each rank's GPU (--gpu NAME), its memory (--gpu-memory GiB) "
                              "or an explicit kv_cache_memory_bytes")
        self.budget = [None if m is None else ceil(m * settings.gpu_memory_utilization)
                       for m in self.memory]
        self.geometry = engine_geometry(spec, self.tp, self.pp, settings, self.kv_dtype)
        self.weights = weight_breakdown(spec, self.tp, checkpoint_dir)
        self.explicit = settings.kv_cache_memory_bytes  # per GPU: no rank gets more
        self.limit = max(self.max_model_len, spec.max_position_embeddings or 0)
        self._estimated: dict[tuple[int, int, int], _NonKV] = {}

    # ------------------------------------------------------------------ per-rank memory
    def non_kv(self, rank: int, stage: int, start: int, end: int) -> _NonKV:
        prof = self.profiles[rank]
        if prof is not None:
            return _NonKV(prof.weights_bytes, prof.activation_bytes, prof.cuda_graph_bytes,
                          prof.non_torch_bytes)
        key = (stage, start, end)  # estimates are the same for every rank of a stage
        if key not in self._estimated:
            self._estimated[key] = self._estimate(stage, start, end)
        return self._estimated[key]

    def _estimate(self, stage: int, start: int, end: int) -> _NonKV:
        last = stage == self.pp - 1
        w = self.weights.stage_bytes(range(start, end), stage == 0, last,
                                     encoders=self.settings.vllm_version is not None)
        s = self.settings
        if s.device == "cpu":  # a CPU worker's resident memory: weights and the process
            return _NonKV(weights=max(0, w - s.cpu_offload_bytes), activation=0,
                          cuda_graphs=0, non_torch=estimates.VLLM_CPU_PROCESS_BYTES)
        graphs = (estimates.cuda_graph_bytes(end - start, self.tp, s.max_num_seqs)
                  if s.cuda_graphs and s.reserve_cuda_graphs else 0)
        return _NonKV(
            weights=max(0, w - s.cpu_offload_bytes),
            activation=estimates.activation_bytes(self.spec, self.tp, s.max_num_batched_tokens,
                                                  s.max_num_seqs, last),
            cuda_graphs=graphs,
            non_torch=estimates.non_torch_bytes(self.tp, self.pp),
        )

    def capacity(self, rank: int, non_kv: _NonKV) -> int | None:
        """KV bytes the rank can hold after everything else (None: memory not given)."""
        budget = self.budget[rank]
        return None if budget is None else budget - non_kv.total

    def ranks_of(self, stage: int) -> range:
        return range(stage * self.tp, (stage + 1) * self.tp)

    def kv_limit(self, rank: int, non_kv: _NonKV) -> int:
        """Most KV bytes the rank may get: its capacity, and no more than a stated
        kv_cache_memory_bytes (a per-GPU figure: what the user knows fits)."""
        limits = [c for c in (self.capacity(rank, non_kv), self.explicit) if c is not None]
        return max(0, min(limits))

    # ------------------------------------------------------------------ optimal partition
    def _stage_holds(self, blocks: int, stage: int, start: int, end: int, kv: StageKV) -> bool:
        need = blocks * kv.bytes_per_block
        return all(need <= self.kv_limit(rank, self.non_kv(rank, stage, start, end))
                   for rank in self.ranks_of(stage))

    def _search(self, blocks: int) -> list[int] | None:
        geo = self.geometry

        def fits(stage: int, start: int, end: int) -> bool:
            return self._stage_holds(blocks, stage, start, end, geo.stage(range(start, end)))

        def longest(stage: int, start: int, limit: int) -> int:
            end = start  # grow the stage one layer at a time
            for stop, kv in geo.grow(start, limit):
                if not self._stage_holds(blocks, stage, start, stop, kv):
                    break
                end = stop
            return end

        return greedy_partition(self.spec.num_layers, self.pp, longest, fits)

    def optimal_partition(self, default: list[int]) -> list[int]:
        if self.pp == 1:
            return default
        smallest = min((b for b in self.geometry.layer_bytes_per_token if b), default=0)
        if not smallest:
            return default
        most = max(min(x for x in (b, self.explicit) if x is not None) for b in self.budget)
        found = best_partition(most // (smallest * self.settings.block_size) + 1, self._search)
        if found is None:
            return default
        blocks, parts = found

        def holds(stage: int, start: int, end: int) -> bool:
            return self._stage_holds(blocks, stage, start, end,
                                     self.geometry.stage(range(start, end)))

        return default if partition_fits(default, holds) else parts

    # ------------------------------------------------------------------ budgets and plan
    def run(self) -> Plan:
        default = even_partition(self.spec.num_layers, self.pp)
        if self.layout.layer_partition is not None:
            partition = validate_partition(self.layout.layer_partition, self.spec.num_layers,
                                           self.pp)
        elif self.policy == "optimal":
            partition = self.optimal_partition(default)
        else:
            partition = default
        stages = stage_layers(partition)
        kvs = [self.geometry.stage(r) for r in stages]
        non_kv, caps = [], []
        for rank in range(self.world):
            stage = rank // self.tp
            nk = self.non_kv(rank, stage, stages[stage].start, stages[stage].stop)
            non_kv.append(nk)
            caps.append(self.capacity(rank, nk))
        budgets = self._budgets(kvs, non_kv, caps)
        ranks = [self._rank_plan(r, stages, kvs, non_kv[r], caps[r], budgets[r])
                 for r in range(self.world)]
        engine = self._engine(ranks, partition)
        notes = []
        if self.policy == "optimal" and partition != default \
                and self.layout.layer_partition is None:
            notes.append(f"optimal layer partition {format_partition(partition)} (default "
                         f"{format_partition(default)}); pass it to the engine")
        if None in self.memory:
            notes.append("GPU memory not given: only kv_cache_memory_bytes sizes the KV cache")
        notes.extend(self.geometry.notes)
        return Plan(self.spec.hf_id or self.spec.name, self.layout, self.settings, ranks,
                    engine, notes)

    def _budgets(self, kvs: list[StageKV], non_kv: list[_NonKV],
                 caps: list[int | None]) -> list[int]:
        explicit = self.explicit
        if self.policy == "uniform":
            return [explicit if explicit is not None else max(0, c or 0) for c in caps]
        stage_of = [r // self.tp for r in range(self.world)]
        limits = [self.kv_limit(r, nk) for r, nk in enumerate(non_kv)]
        if self.policy == "proportional":
            # a stated value is one tensor-parallel column's total (seed 001); without one,
            # the ranks' capacities pooled and shared out again
            column = explicit if explicit is not None else \
                sum(max(0, c or 0) for c in caps) // self.tp
            shares = [self._proportional_share(column, kvs, s) for s in stage_of]
        else:  # optimal: the most blocks every rank can hold within its limit
            most = [lim // kvs[s].bytes_per_block
                    for lim, s in zip(limits, stage_of, strict=True) if kvs[s].bytes_per_block]
            blocks = max(0, min(most)) if most else 0
            shares = [blocks * kvs[s].bytes_per_block for s in stage_of]
        return [min(share, lim) for share, lim in zip(shares, limits, strict=True)]

    @staticmethod
    def _proportional_share(column: int, kvs: list[StageKV], stage: int) -> int:
        """Stage's part of one pipeline column's KV bytes, by bytes per block, so that
        every stage holds the same number of blocks."""
        weights = [kv.bytes_per_block for kv in kvs]
        return column * weights[stage] // (sum(weights) or 1)

    def _rank_plan(self, rank: int, stages: list[range], kvs: list[StageKV], nk: _NonKV,
                   cap: int | None, kv_budget: int) -> RankPlan:
        stage = rank // self.tp
        kv = kvs[stage]
        per_block = kv.bytes_per_block
        layers = stages[stage]
        # Block 0 is the null block (it pads block tables), counted in the blocks.
        if per_block:
            blocks = kv_budget // per_block
            longest = self.geometry.longest_fitting(layers, kv, kv_budget, self.limit)
        else:  # no paged layers here: this rank never limits the blocks (set by _engine)
            blocks, longest = 0, self.limit
        need = self.geometry.need_bytes(layers, kv, self.max_model_len) if per_block else 0
        over = cap is not None and kv_budget > max(0, cap)
        return RankPlan(
            rank=rank, pp_stage=stage, tp_rank=rank % self.tp, layers=list(stages[stage]),
            memory_bytes=self.memory[rank], budget_bytes=self.budget[rank],
            weights_bytes=nk.weights, activation_bytes=nk.activation,
            cuda_graph_bytes=nk.cuda_graphs, non_torch_bytes=nk.non_torch,
            kv_capacity_bytes=cap, kv_budget_bytes=kv_budget,
            kv_bytes_per_token=kv.kv_bytes_per_token,
            num_slots=kv.num_slots, slot_page_bytes=kv.slot_page_bytes,
            bytes_per_block=per_block, num_blocks=blocks, tokens=self.geometry.tokens(blocks),
            kv_heads_on_rank=kv.kv_heads_on_rank, need_bytes_at_max_model_len=need,
            max_model_len_that_fits=longest, fits=need <= kv_budget and not over,
            over_committed=over,
        )

    def _engine(self, ranks: list[RankPlan], partition: list[int]) -> EnginePlan:
        paged = [r.num_blocks for r in ranks if r.bytes_per_block]
        blocks = min(paged) if paged else 0
        for r in ranks:  # ranks without paged layers hold whatever the others hold
            if not r.bytes_per_block:
                r.num_blocks, r.tokens = blocks, self.geometry.tokens(blocks)
        # the scheduler's groups: the global ones, or rank 0's where each stage has its own
        size, concurrency = self.geometry.kv_cache_size(
            blocks, self.max_model_len, stage_layers(partition)[0])
        return EnginePlan(
            num_blocks=blocks, tokens=self.geometry.tokens(blocks),
            max_concurrency=concurrency, kv_cache_size_tokens=size, rules=self.geometry.name,
            fits=all(r.fits for r in ranks), max_model_len=self.max_model_len,
            max_model_len_that_fits=min(r.max_model_len_that_fits for r in ranks),
            layer_partition=list(partition), policy=self.policy,
            block_size=self.geometry.block_size, kv_dtype=self.kv_dtype,
            num_kv_groups=self.geometry.num_groups,
            num_state_groups=self.geometry.num_state_groups,
        )
