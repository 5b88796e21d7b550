"""Checks of the planner's inputs; each failure is one ConfigError line naming the problem."""

from __future__ import annotations

from kvmem.errors import ConfigError
from kvmem.plan.gpus import gpu_memory_bytes
from kvmem.plan.types import POLICIES, EngineSettings, Layout, RankProfile
from kvmem.spec import ModelSpec, resolve_kv_dtype


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_layout(spec: ModelSpec, layout: Layout) -> None:
    tp = _positive_int(layout.tensor_parallel_size, "tensor_parallel_size")
    pp = _positive_int(layout.pipeline_parallel_size, "pipeline_parallel_size")
    if spec.num_attention_heads % tp:
        raise ConfigError(f"tensor_parallel_size {tp} does not divide the model's "
                          f"{spec.num_attention_heads} attention heads")
    kv = spec.num_kv_heads
    if spec.mla is None and (kv % tp if tp <= kv else tp % kv):
        raise ConfigError(f"tensor_parallel_size {tp} and the model's {kv} KV heads must divide "
                          "one another (heads are split, or replicated when tp exceeds them)")
    if pp > spec.num_layers:
        raise ConfigError(f"pipeline_parallel_size {pp} exceeds the model's {spec.num_layers} "
                          "layers")
    if layout.gpus is not None and layout.gpu_memory_bytes is not None:
        raise ConfigError("give GPUs by name or by memory size, not both")


def _per_rank(values: list, world: int, what: str) -> list:
    if len(values) == 1:
        return values * world
    if len(values) != world:
        raise ConfigError(f"{what}: {len(values)} given for {world} ranks (give one per rank, "
                          "rank = pp_stage * tp + tp_rank, or one for all)")
    return list(values)


def rank_memory(layout: Layout) -> list[int | None]:
    """Each rank's total device memory in bytes (None when not given)."""
    world = layout.world_size
    if layout.gpus:
        return [gpu_memory_bytes(g) for g in _per_rank(list(layout.gpus), world, "GPUs")]
    mem = layout.gpu_memory_bytes
    if mem is None:
        return [None] * world
    sizes = _per_rank(list(mem) if isinstance(mem, (list, tuple)) else [mem], world,
                      "GPU memory sizes")
    for size in sizes:
        _positive_int(size, "GPU memory")
    return sizes


def rank_profiles(profile: list[RankProfile] | None, world: int) -> list[RankProfile | None]:
    if not profile:
        return [None] * world
    profiles = _per_rank(list(profile), world, "rank profiles")
    for p in profiles:
        _positive_int(p.total_bytes, "profile total_bytes")
        for name in ("weights_bytes", "activation_bytes", "non_torch_bytes"):
            if getattr(p, name) < 0:
                raise ConfigError(f"profile {name} must not be negative")
    return profiles


def check_settings(spec: ModelSpec, settings: EngineSettings, policy: str) -> tuple[str, int]:
    """Validate the settings; return (KV dtype stored, max_model_len)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown KV budget policy {policy!r}; choose one of "
                          f"{', '.join(POLICIES)}")
    util = settings.gpu_memory_utilization
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    if settings.kv_cache_memory_bytes is not None:
        _positive_int(settings.kv_cache_memory_bytes, "kv_cache_memory_bytes")
    _positive_int(settings.block_size, "block_size")
    _positive_int(settings.max_num_seqs, "max_num_seqs")
    _positive_int(settings.max_num_batched_tokens, "max_num_batched_tokens")
    if settings.device not in ("gpu", "cpu"):
        raise ConfigError(f"device must be 'gpu' or 'cpu', got {settings.device!r}")
    if settings.max_concurrent_batches is not None:
        _positive_int(settings.max_concurrent_batches, "max_concurrent_batches")
    offload = settings.cpu_offload_bytes
    if isinstance(offload, bool) or not isinstance(offload, int) or offload < 0:
        raise ConfigError(f"cpu_offload_bytes must be a non-negative integer, got {offload!r}")
    kv_dtype = resolve_kv_dtype(settings.kv_cache_dtype, spec.dtype)
    if settings.max_model_len is not None:
        return kv_dtype, _positive_int(settings.max_model_len, "max_model_len")
    if spec.max_position_embeddings is None:
        raise ConfigError(f"{spec.name}: config has no max_position_embeddings; give "
                          "max_model_len")
    return kv_dtype, _positive_int(spec.max_position_embeddings, "max_position_embeddings")
