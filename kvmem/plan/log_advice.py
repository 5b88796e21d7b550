"""What kvmem would do better than a logged vLLM deployment, each planned, with the command.

For a start that failed its check: each rank's need against its memory and the
deployment that starts (the same one where every rank fits its own memory, else the
longest context that does). Otherwise: proportional or optimal KV budgets through kvmem's
vLLM plugin where pipeline stages differ, a longer context, an fp8 KV cache. Each
command is the user's vLLM command as the log states it, with the change. Imports no torch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from kvmem.plan.flags import PLUGIN_POLICY_ENV
from kvmem.plan.log_deployment import Deployment, plan_logged
from kvmem.plan.partition import format_partition
from kvmem.plan.types import Plan
from kvmem.plan.vllm_log import VllmLog
from kvmem.plan.vllm_release import CHECK_FIRST_GROUP, CHECK_GLOBAL, VllmRelease
from kvmem.spec import ModelSpec
from kvmem.units import format_bytes


@dataclass
class Better:
    """Something kvmem would do better, its figures and the command."""

    what: str
    figures: str
    command: str


def _command(log: VllmLog, model: str, d: Deployment, env: dict[str, str] | None = None,
             **flags) -> str:
    """The user's vLLM command as the log states it, with ``flags`` changed."""
    s = d.settings
    argv = {"tensor-parallel-size": d.layout.tensor_parallel_size,
            "pipeline-parallel-size": d.layout.pipeline_parallel_size,
            "max-model-len": s.max_model_len, "block-size": s.block_size,
            "max-num-batched-tokens": s.max_num_batched_tokens}
    for key in ("kv_cache_dtype", "gpu_memory_utilization", "kv_cache_memory_bytes",
                "max_num_seqs"):
        if key in log.args:
            argv[key.replace("_", "-")] = log.args[key]
    if s.speculative_config is not None:
        argv["speculative-config"] = s.speculative_config
    argv.update({k.replace("_", "-"): v for k, v in flags.items()})
    words = [f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    words += ["vllm", "serve", shlex.quote(model)]
    for key, value in argv.items():
        if value is not None:
            words += [f"--{key}", shlex.quote(str(value))]
    return " ".join(words)


def better(log: VllmLog, spec: ModelSpec, d: Deployment, base: Plan,
            model: str) -> list[Better]:
    memory = [b[0] for b in d.budgets]
    e, out = base.engine, []
    if not e.fits:
        out += _what_starts(log, spec, d, base, model)
    if d.layout.pipeline_parallel_size > 1:
        for policy in ("proportional", "optimal"):
            p = plan_logged(spec, d, memory, policy)
            if p.engine.num_blocks > e.num_blocks or p.engine.layer_partition != \
                    e.layer_partition:
                env = {PLUGIN_POLICY_ENV: policy}
                if p.engine.layer_partition != e.layer_partition:
                    env["VLLM_PP_LAYER_PARTITION"] = format_partition(p.engine.layer_partition)
                out.append(Better(
                    f"{policy} KV budgets (kvmem's vLLM plugin)",
                    f"{p.engine.num_blocks:,} blocks, {p.engine.kv_cache_size_tokens:,} tokens"
                    f", {p.engine.max_concurrency:.2f}x (now {e.num_blocks:,} blocks, "
                    f"{e.max_concurrency:.2f}x) from the same KV memory",
                    _command(log, model, d, env)))
    longest = min(r.max_model_len_that_fits for r in base.ranks)
    if e.fits and longest > e.max_model_len:
        out.append(Better("a longer context", f"max_model_len up to {longest:,} fits every "
                          "rank's KV memory", _command(log, model, d, max_model_len=longest)))
    if base.engine.kv_dtype in ("bfloat16", "float16", "float32"):
        p = plan_logged(spec, d, memory, kv_cache_dtype="fp8")
        if p.engine.fits and (p.engine.num_blocks > e.num_blocks or not e.fits):
            out.append(Better("an fp8 KV cache", f"{p.engine.num_blocks:,} blocks, "
                              f"{p.engine.kv_cache_size_tokens:,} tokens, "
                              f"{p.engine.max_concurrency:.2f}x",
                              _command(log, model, d, kv_cache_dtype="fp8")))
    return out


def _needs(p: Plan) -> str:
    """``ranks 0-7 need 13.98 GiB of 15.57 GiB; ...``: ranks with the same figures
    together."""
    runs: list[tuple[list[int], str]] = []
    for r in p.ranks:
        text = (f"{format_bytes(r.need_bytes_at_max_model_len)} of "
                f"{format_bytes(r.kv_budget_bytes)}")
        if runs and runs[-1][1] == text and runs[-1][0][-1] == r.rank - 1:
            runs[-1][0].append(r.rank)
        else:
            runs.append(([r.rank], text))
    parts = []
    for ranks, text in runs:
        who = f"rank {ranks[0]} needs" if len(ranks) == 1 else \
            f"ranks {ranks[0]}-{ranks[-1]} need"
        parts.append(f"{who} {text}")
    return "; ".join(parts)


def _what_starts(log: VllmLog, spec: ModelSpec, d: Deployment, base: Plan,
                 model: str) -> list[Better]:
    """For a failed start: the per-rank need, and deployments that start."""
    out = []
    per_rank = plan_logged(spec, d, [b[0] for b in d.budgets],
                     vllm_version=VllmRelease.parse("0.33").name)
    needs = _needs(per_rank)
    why = {CHECK_GLOBAL: f"vLLM {d.release.name} compares the whole model's need with the "
                         "smallest worker's memory; from 0.17 each rank's own",
           CHECK_FIRST_GROUP: f"vLLM {d.release.name} charges every KV cache group like the "
                              "first; from 0.19 each its own"}.get(d.release.fit_check)
    if per_rank.engine.fits:
        out.append(Better("the same deployment, checked per rank",
                          f"{needs}: every rank fits" + (f" ({why})" if why else ""),
                          _command(log, model, d)))
        return out
    out.append(Better("per-rank need", needs, ""))
    longest = min(r.max_model_len_that_fits for r in per_rank.ranks)
    if longest:
        out.append(Better("the longest context that starts", f"max_model_len {longest:,}",
                          _command(log, model, d, max_model_len=longest)))
    return out
