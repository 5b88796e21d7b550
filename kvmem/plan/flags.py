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
    """(one KV budget every rank can hold, whether it is the largest per-rank budget).

    The largest per-rank budget when every rank has room for it, else the smallest KV
    capacity over the ranks (a rank without a known capacity holds anything)."""
    largest = max(r.kv_budget_bytes for r in plan.ranks)
    caps = [max(0, r.kv_capacity_bytes) for r in plan.ranks if r.kv_capacity_bytes is not None]
    if all(largest <= c for c in caps):
        return largest, True
    return min(caps), False


def _uniform_blocks(plan: Plan, budget: int) -> int:
    """Blocks one budget on every rank gives: the least over the ranks with paged layers."""
    blocks = [budget // r.bytes_per_block for r in plan.ranks if r.bytes_per_block]
    return min(blocks) if blocks else 0


def _uniform_note(plan: Plan, budget: int, largest: bool) -> str:
    e = plan.engine
    blocks = _uniform_blocks(plan, budget)
    tokens = blocks * e.block_size // max(1, e.num_kv_groups)
    source = ("the largest per-rank budget; every rank reserves all of it" if largest
              else "the smallest rank's KV capacity; the largest per-rank budget does not fit "
                   "on every rank")
    return (f"vLLM takes one KV budget for every rank: {budget:,} bytes ({source}) gives "
            f"{blocks:,} blocks ({tokens:,} tokens); `kvmem serve` with per-rank budgets "
            f"reaches the plan's {e.num_blocks:,} blocks ({e.tokens:,} tokens)")


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
    if s.kv_cache_memory_bytes is not None or plan.engine.policy != "uniform":
        budget, largest = _uniform_budget(plan)
        argv += ["--kv-cache-memory-bytes", str(budget)]
        if len({r.kv_budget_bytes for r in plan.ranks}) > 1 or not largest:
            cmd.notes.append(_uniform_note(plan, budget, largest))
    else:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
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
