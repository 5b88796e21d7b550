"""The command line and environment that make vLLM, SGLang or kvmem run a plan.

vLLM takes one KV budget for every rank. When a plan gives ranks different budgets, the
plain vLLM command carries the one value every rank can hold (and says what it buys), and
a second command runs the plan itself through kvmem's vLLM plugin: the ``kvmem`` package
registers it under vLLM's ``vllm.general_plugins`` entry point, and
``KVMEM_VLLM_KV_BUDGET`` (uniform, proportional or optimal) selects the policy.
SGLang has no kvmem plugin: its command says what it cannot express.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kvmem.errors import ConfigError
from kvmem.plan.partition import even_partition, format_partition
from kvmem.plan.types import Plan
from kvmem.units import format_bytes

ENGINES = ("vllm", "sglang", "kvmem")
PLUGIN_POLICY_ENV = "KVMEM_VLLM_KV_BUDGET"  # read by kvmem.integrations.vllm


@dataclass
class EngineCommand:
    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plugin: EngineCommand | None = None  # the same engine with kvmem's plugin: runs the plan

    def to_dict(self) -> dict:
        out = {"argv": self.argv, "env": self.env, "notes": self.notes}
        if self.plugin is not None:
            out["plugin"] = self.plugin.to_dict()
        return out

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{env} {cmd}" if env else cmd


def _partition(plan: Plan) -> str | None:
    parts = plan.engine.layer_partition
    return format_partition(parts) if len(parts) > 1 else None


def _custom_partition(plan: Plan) -> str | None:
    """The partition when it is not vLLM's default split (which needs no variable)."""
    parts = plan.engine.layer_partition
    return None if parts == even_partition(sum(parts), len(parts)) else format_partition(parts)


def _uneven(plan: Plan) -> bool:
    return len({r.kv_budget_bytes for r in plan.ranks}) > 1


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
    spent, planned = budget * len(plan.ranks), sum(r.kv_budget_bytes for r in plan.ranks)
    return (f"vLLM takes one KV budget for every rank: {budget:,} bytes ({source}) gives "
            f"{blocks:,} blocks ({tokens:,} tokens) for {format_bytes(spent)} of KV over "
            f"{len(plan.ranks)} GPUs; the plan's per-rank budgets hold {e.num_blocks:,} "
            f"blocks ({e.tokens:,} tokens) in {format_bytes(planned)}")


def engine_command(plan: Plan, engine: str, model: str) -> EngineCommand:
    """The command for ``engine``; ``model`` is named exactly as the user gave it."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    cmd = {"vllm": _vllm, "sglang": _sglang, "kvmem": _kvmem}[engine](plan, model)
    if plan.engine.num_blocks == 0:  # the fit error says why
        cmd.notes.insert(0, "this plan holds no KV blocks (see the error above): the engine "
                            "will not start with these flags")
    return cmd


def _vllm_argv(plan: Plan, model: str) -> list[str]:
    s, e, lay = plan.settings, plan.engine, plan.layout
    kv_dtype = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}.get(e.kv_dtype, "auto")
    argv = ["vllm", "serve", model,
            "--tensor-parallel-size", str(lay.tensor_parallel_size),
            "--pipeline-parallel-size", str(lay.pipeline_parallel_size),
            "--max-model-len", str(e.max_model_len), "--block-size", str(e.block_size),
            "--kv-cache-dtype", kv_dtype, "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    return argv


def _vllm_tail(plan: Plan) -> list[str]:
    s, argv = plan.settings, []
    if s.cpu_offload_bytes:
        argv += ["--cpu-offload-gb", f"{s.cpu_offload_bytes / (1 << 30):g}"]
    if not s.cuda_graphs:
        argv.append("--enforce-eager")
    if s.hybrid_kv_cache_manager is False:
        argv.append("--disable-hybrid-kv-cache-manager")
    if s.speculative_config is not None:
        argv += ["--speculative-config", s.speculative_config]
    if not s.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    for flag, dtype in (("--mamba-cache-dtype", s.mamba_cache_dtype),
                        ("--mamba-ssm-cache-dtype", s.mamba_ssm_cache_dtype)):
        if dtype != "auto":
            argv += [flag, dtype]
    if s.replayssm_buffer_len is not None:
        argv += ["--use-replayssm", "--replayssm-buffer-len", str(s.replayssm_buffer_len)]
    if s.mamba_backend != "triton":
        argv += ["--mamba-backend", s.mamba_backend]
    return argv


def _vllm(plan: Plan, model: str) -> EngineCommand:
    s = plan.settings
    cmd = EngineCommand("vllm", _vllm_argv(plan, model))
    if (part := _custom_partition(plan)) is not None:
        cmd.env["VLLM_PP_LAYER_PARTITION"] = part
    if not _uneven(plan) and s.kv_cache_memory_bytes is None and plan.engine.policy == "uniform":
        cmd.argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    elif not _uneven(plan):
        cmd.argv += ["--kv-cache-memory-bytes", str(plan.ranks[0].kv_budget_bytes)]
    else:  # one value for every rank: the most each rank can hold, and what it buys
        budget, largest = _uniform_budget(plan)
        cmd.argv += ["--kv-cache-memory-bytes", str(budget)]
        cmd.notes.append(_uniform_note(plan, budget, largest))
        cmd.plugin = _vllm_plugin(plan, model)
        cmd.notes.append(
            f"kvmem's vLLM plugin (installed with the kvmem package, registered under "
            f"vllm.general_plugins) gives each rank its own budget: run the plugin command "
            f"with {PLUGIN_POLICY_ENV}={plan.engine.policy}")
    cmd.argv += _vllm_tail(plan)
    return cmd


def _vllm_plugin(plan: Plan, model: str) -> EngineCommand:
    """vLLM with kvmem's plugin: the stated value (or the utilisation) and the policy; the
    plugin repeats this plan on every rank."""
    s = plan.settings
    cmd = EngineCommand("vllm", _vllm_argv(plan, model),
                        env={PLUGIN_POLICY_ENV: plan.engine.policy})
    if (part := _custom_partition(plan)) is not None:
        cmd.env["VLLM_PP_LAYER_PARTITION"] = part
    if s.kv_cache_memory_bytes is not None:
        cmd.argv += ["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)]
    else:
        cmd.argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    cmd.argv += _vllm_tail(plan)
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
    if (part := _partition(plan)) is not None:  # SGLang's default split may differ: say it
        cmd.env["SGLANG_PP_LAYER_PARTITION"] = part
    if _uneven(plan):
        cmd.notes.append(
            "SGLang takes one memory fraction for every rank and kvmem has no SGLang plugin, "
            "so the plan's per-rank KV budgets cannot be expressed: --max-total-tokens caps "
            f"the pool at the plan's {e.tokens:,} tokens, but every rank still reserves the "
            "largest rank's share; `kvmem serve` (or vLLM with kvmem's plugin) runs the plan")
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
