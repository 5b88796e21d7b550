"""The command line and environment that make vLLM, SGLang or kvmem run a plan."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kvmem.errors import ConfigError
from kvmem.plan.partition import format_partition
from kvmem.plan.types import Plan

ENGINES = ("vllm", "sglang", "kvmem")


@dataclass
class EngineCommand:
    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{env} {cmd}" if env else cmd


def _partition(plan: Plan) -> str | None:
    parts = plan.engine.layer_partition
    return format_partition(parts) if len(parts) > 1 else None


def _uniform_budget(plan: Plan) -> tuple[int, bool]:
    """(the one KV budget an engine with a single setting needs, whether ranks differ)."""
    budgets = {r.kv_budget_bytes for r in plan.ranks}
    return max(budgets), len(budgets) > 1


def engine_command(plan: Plan, engine: str, model: str) -> EngineCommand:
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    return {"vllm": _vllm, "sglang": _sglang, "kvmem": _kvmem}[engine](plan, model)


def _vllm(plan: Plan, model: str) -> EngineCommand:
    s, e, lay = plan.settings, plan.engine, plan.layout
    kv_dtype = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}.get(e.kv_dtype, "auto")
    argv = ["vllm", "serve", model,
            "--tensor-parallel-size", str(lay.tensor_parallel_size),
            "--pipeline-parallel-size", str(lay.pipeline_parallel_size),
            "--max-model-len", str(e.max_model_len), "--block-size", str(e.block_size),
            "--kv-cache-dtype", kv_dtype, "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    cmd = EngineCommand("vllm", argv)
    budget, differ = _uniform_budget(plan)
    if s.kv_cache_memory_bytes is not None or plan.engine.policy != "uniform":
        argv += ["--kv-cache-memory-bytes", str(budget)]
    else:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if differ:
        cmd.notes.append("vLLM takes one KV budget for every rank: the largest per-rank budget "
                         "is given; the smaller stages leave part of it unused")
    if s.cpu_offload_bytes:
        argv += ["--cpu-offload-gb", f"{s.cpu_offload_bytes / (1 << 30):g}"]
    if not s.cuda_graphs:
        argv.append("--enforce-eager")
    if (part := _partition(plan)) is not None:
        cmd.env["VLLM_PP_LAYER_PARTITION"] = part
    return cmd


def _sglang(plan: Plan, model: str) -> EngineCommand:
    s, e, lay = plan.settings, plan.engine, plan.layout
    kv_dtype = e.kv_dtype if e.kv_dtype.startswith("fp8") else "auto"
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model,
            "--tp-size", str(lay.tensor_parallel_size), "--pp-size",
            str(lay.pipeline_parallel_size), "--context-length", str(e.max_model_len),
            "--page-size", str(e.block_size), "--kv-cache-dtype", kv_dtype,
            "--max-running-requests", str(s.max_num_seqs),
            "--chunked-prefill-size", str(s.max_num_batched_tokens),
            "--max-total-tokens", str(e.tokens)]
    cmd = EngineCommand("sglang", argv)
    fractions = [(r.weights_bytes + r.kv_budget_bytes) / r.memory_bytes
                 for r in plan.ranks if r.memory_bytes]
    if fractions:  # weights + KV pool as a share of the device, rounded up to 0.001
        argv += ["--mem-fraction-static", f"{-(-max(fractions) * 1000 // 1) / 1000:.3f}"]
    else:
        cmd.notes.append("no GPU memory given: set --mem-fraction-static for your GPU")
    if not s.cuda_graphs:
        argv.append("--disable-cuda-graph")
    if (part := _partition(plan)) is not None:
        cmd.env["SGLANG_PP_LAYER_PARTITION"] = part
    return cmd


def _kvmem(plan: Plan, model: str) -> EngineCommand:
    s, e, lay = plan.settings, plan.engine, plan.layout
    argv = ["kvmem", "serve", model,
            "--tensor-parallel-size", str(lay.tensor_parallel_size),
            "--pipeline-parallel-size", str(lay.pipeline_parallel_size)]
    if (part := _partition(plan)) is not None:
        argv += ["--layer-partition", part]
    if s.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)]
    else:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    argv += ["--kv-budget", e.policy, "--block-size", str(e.block_size),
             "--max-model-len", str(e.max_model_len), "--kv-cache-dtype", s.kv_cache_dtype,
             "--max-num-seqs", str(s.max_num_seqs),
             "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    if not s.cuda_graphs:
        argv.append("--enforce-eager")
    return EngineCommand("kvmem", argv)
