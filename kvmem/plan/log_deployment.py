"""The deployment a vLLM start-up log describes, rebuilt for planning.

``deployment(log, spec, version)`` takes the release, layout, max_model_len, block size (as
the user set it: the planner raises it for linear-attention states as vLLM does), KV dtype,
batched tokens, batches in flight, hybrid-manager setting and speculative config from the
log (its engine config line and non-default args), vLLM's defaults for what it does not
state (each noted), and each rank's KV memory: a stated ``kv_cache_memory_bytes`` exactly,
else each worker's logged figure as the interval its rounding stands for, else the blocks
the logged KV cache size stands for. Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from kvmem.errors import ConfigError, KvmemError
from kvmem.plan.estimates import vllm_batch_defaults, vllm_cpu_defaults
from kvmem.plan.geometry import Geometry
from kvmem.plan.planner import engine_geometry, plan
from kvmem.plan.types import EngineSettings, Layout, Plan, RankProfile
from kvmem.plan.vllm_backends import BACKENDS
from kvmem.plan.vllm_log import VllmLog
from kvmem.plan.vllm_release import DEFAULT_VERSION, VllmRelease
from kvmem.spec import ModelSpec, resolve_kv_dtype


@dataclass
class Deployment:
    release: VllmRelease
    layout: Layout
    settings: EngineSettings
    budgets: list[tuple[int, int]]  # each rank's KV memory: (low, high) bytes
    notes: list[str]


# The most each whole-number setting may be, so that a garbled log is one error line.
_LIMITS = {"tensor_parallel_size": 1024, "pipeline_parallel_size": 1024,
           "max_model_len": 1 << 40, "block_size": 1 << 20,
           "max_num_batched_tokens": 1 << 40, "max_num_seqs": 1 << 24}


def _setting(log: VllmLog, key: str, config_key: str | None = None) -> int | None:
    """A whole-number setting from the non-default args, else the engine config line;
    ConfigError when the log gives it as anything else."""
    value = log.args.get(key)
    if value is None and config_key:
        raw = log.config.get(config_key)
        value = int(raw) if raw is not None and raw.isdigit() and len(raw) < 16 else raw
    return _whole(value, key)


def _whole(value: object, key: str) -> int | None:
    limit = _LIMITS[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"the log gives {key} as {shown}: kvmem reads a whole number from 1 "
                          f"to {limit:,}")
    return value


def deployment(log: VllmLog, spec: ModelSpec, version: str | None) -> Deployment:
    """The deployment the log describes; what it does not state is vLLM's default, noted."""
    notes: list[str] = []
    if version is None and log.version is None:
        notes.append(f"the log names no vLLM version: vLLM {DEFAULT_VERSION}'s rules assumed")
    release = VllmRelease.parse(version or log.version or DEFAULT_VERSION)
    if release.newer_than_known:
        notes.append(f"vLLM {release.name} is newer than the releases whose rules kvmem "
                     "read (0.9 to 0.33): 0.33's rules assumed")
    tp = _setting(log, "tensor_parallel_size", "tensor_parallel_size") or 1
    pp = _setting(log, "pipeline_parallel_size", "pipeline_parallel_size") or 1
    device = "cpu" if log.config.get("device_config") == "cpu" else "gpu"
    max_len = (_whole(log.max_model_len, "max_model_len")
               or _setting(log, "max_model_len", "max_seq_len") or spec.max_position_embeddings)
    if not isinstance(max_len, int):
        raise ConfigError("the log does not say max_model_len and the model's config has no "
                          "max_position_embeddings")
    block = _setting(log, "block_size")  # the user's: vLLM's raise for states is planned
    backend = None
    if block is None and log.backend_block_size is not None:
        _, block, names = log.backend_block_size
        backend = names.split("/")[0]
        notes.append(f"block size {block}: vLLM set it for its {names} backend(s)")
    if block is None:
        block = vllm_cpu_defaults(spec, tp * pp, amx=None if log.cpu_mla is None
                                  else log.cpu_mla == "AMX_MLA")[0] if device == "cpu" else 16
        notes.append(f"block size {block}: vLLM's default on "
                     f"{'its CPU build' if device == 'cpu' else 'GPUs'} (the log does not "
                     "say)")
    batched = (_whole(log.max_num_batched_tokens, "max_num_batched_tokens")
               or _setting(log, "max_num_batched_tokens"))
    if batched is None:
        batched = vllm_batch_defaults(None)[0]
        notes.append(f"max_num_batched_tokens {batched}: assumed (the log does not say); "
                     "it decides sliding-window and chunked charges")
    kv_dtype = resolve_kv_dtype(str(log.config.get("kv_cache_dtype") or "auto"),
                                str(log.config.get("dtype") or spec.dtype))
    hybrid = False if (log.hybrid_disabled or log.args.get("disable_hybrid_kv_cache_manager")) \
        else None
    batches = None
    if log.args.get("async_scheduling") is False:
        batches = pp
    settings = EngineSettings(
        speculative_config=_speculative_config(log, spec, notes),
        gpu_memory_utilization=1.0, block_size=int(block), max_model_len=int(max_len),
        max_num_seqs=_setting(log, "max_num_seqs") or 256,
        max_num_batched_tokens=int(batched), cuda_graphs=False, kv_cache_dtype=kv_dtype,
        vllm_version=release.name, device=device, max_concurrent_batches=batches,
        hybrid_kv_cache_manager=hybrid, cpu_avx512_bf16=log.ssm_float32,
        cpu_amx=None if log.cpu_mla is None else log.cpu_mla == "AMX_MLA",
        attention_backend=backend if backend in BACKENDS and device == "gpu"
        and release.gpu_backend_block_size else None,
        # the engine config line's; vLLM's default (on) when it does not say
        enable_prefix_caching=log.config.get("enable_prefix_caching") != "False")
    layout = Layout(tensor_parallel_size=int(tp), pipeline_parallel_size=int(pp))
    d = Deployment(release, layout, settings, _budgets(log, tp * pp, tp, notes), notes)
    if not d.budgets:
        d.budgets = _budgets_from_size(log, spec, d)
    return d


def _speculative_config(log: VllmLog, spec: ModelSpec, notes: list[str]) -> str | None:
    """vLLM's ``--speculative-config`` as the log states it (the engine config's, else the
    non-default args'), when kvmem can plan its draft; else None, noted."""
    logged = log.speculative or log.args.get("speculative_config")
    if not isinstance(logged, dict) or not logged:
        return None
    method = logged.get("method")
    if isinstance(method, str) and method.endswith("_mtp"):  # qwen3_next_mtp: vLLM's "mtp"
        method = "mtp"
    tokens = logged.get("num_spec_tokens", logged.get("num_speculative_tokens"))
    config = {"method": method, "num_speculative_tokens": tokens}
    if method != "mtp" and logged.get("model"):
        config["model"] = logged["model"]
    text = json.dumps(config)
    from kvmem.spec.speculative import speculative_spec

    try:
        speculative_spec(spec, text)
    except KvmemError as exc:
        notes.append(f"the log runs speculative decoding ({method}, {tokens} tokens), which "
                     f"kvmem cannot plan ({exc}): the draft's KV and lookahead are left out")
        return None
    notes.append(f"speculative decoding as logged: --speculative-config '{text}'")
    return text


def _budgets(log: VllmLog, world: int, tp: int, notes: list[str]) -> list[tuple[int, int]]:
    """Each rank's KV memory: a stated kv_cache_memory_bytes exactly, else each worker's
    logged figure (its rounding interval)."""
    stated = log.args.get("kv_cache_memory_bytes")
    if isinstance(stated, int) and stated > 0:
        return [(stated, stated)] * world
    by_rank: dict[int, tuple[int, int]] = {}
    for order, w in enumerate(log.workers):
        if w.rank is not None:
            rank = w.rank
        elif w.pp_rank is not None or w.tp_rank is not None:
            rank = (w.pp_rank or 0) * tp + (w.tp_rank or 0)
        else:
            rank = order
        by_rank.setdefault(rank, w.bytes_range)
    if not by_rank:
        return []
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        least = min(by_rank.values())
        notes.append(f"the log gives the KV memory of {len(by_rank)} of {world} workers: "
                     f"rank{'s' if len(missing) > 1 else ''} "
                     f"{', '.join(map(str, missing))} taken as the least logged")
        by_rank.update({r: least for r in missing})
    return [by_rank[r] for r in range(world)]


def _budgets_from_size(log: VllmLog, spec: ModelSpec, d: Deployment) -> list[tuple[int, int]]:
    """Without any worker's KV memory: the blocks the logged KV cache size stands for (the
    size grows with the blocks), as every rank's budget."""
    if not log.sizes:
        raise ConfigError("the log gives no worker's KV cache memory (\"Available KV cache "
                          "memory\"), no kv_cache_memory_bytes and no KV cache size: kvmem "
                          "cannot size it")
    tokens = log.sizes[0][2]
    probe = plan_logged(spec, d, [1] * d.layout.world_size)
    geometry = logged_geometry(spec, d, probe)
    first = probe.ranks[0].layers

    def size(blocks: int) -> int:
        return geometry.kv_cache_size(blocks, probe.engine.max_model_len, first)[0]

    def least(target: int) -> int:  # the fewest blocks whose size reaches target
        lo, hi = 0, 1
        while size(hi) < target:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) < target else (lo, mid)
        return hi

    low, high = least(tokens), least(tokens + 1) - 1
    d.notes.append(f"the log gives no worker's KV memory: the {low:,} to {high:,} blocks its KV "
                   f"cache size of {tokens:,} tokens stands for are taken as every rank's")
    return [(low * r.bytes_per_block, (high + 1) * r.bytes_per_block - 1) for r in probe.ranks]


def logged_geometry(spec: ModelSpec, d: Deployment, planned: Plan) -> Geometry:
    """The rules ``planned`` was sized by: the release's, for the model with the logged
    speculative draft, as the planner takes them."""
    if planned.settings.speculative_config is not None:
        from kvmem.spec.speculative import speculative_spec

        spec = speculative_spec(spec, planned.settings.speculative_config)
    return engine_geometry(spec, d.layout.tensor_parallel_size,
                           d.layout.pipeline_parallel_size, planned.settings,
                           planned.engine.kv_dtype)


def plan_logged(spec: ModelSpec, d: Deployment, memory: list[int], policy: str = "uniform",
                **changes) -> Plan:
    """The deployment planned with ``memory`` of KV on each rank and ``changes`` to its
    settings (as kvmem's vLLM plugin plans a running vLLM: each rank's KV memory is all
    it has)."""
    return plan(spec, d.layout, replace(d.settings, **changes), policy,
                profile=[RankProfile(0, 0, 0, 0, max(1, m)) for m in memory], suggest=False)
