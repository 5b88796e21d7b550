"""A vLLM start-up log against kvmem's plan of the same deployment, and what would do better.

``compare_log(log, spec, model)`` rebuilds the deployment the log describes (release,
layout, max_model_len, block size, KV dtype, batched tokens, each worker's KV memory),
plans it under that release's rules (``kvmem.plan.vllm_rules``), and sets vLLM's figures
beside kvmem's: per rank, and for the engine (KV cache size, maximum concurrency, the
start-up check's need and estimate). A figure vLLM logged rounded (GiB to two decimals)
is compared with kvmem's figures at both ends of its rounding interval. Where a figure
differs, the settings the log does not state are varied to say which value explains it.
Then what kvmem would do better, each planned and with the command to paste.
Imports no torch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from kvmem.errors import ConfigError
from kvmem.plan.estimates import vllm_batch_defaults, vllm_cpu_defaults
from kvmem.plan.flags import PLUGIN_POLICY_ENV
from kvmem.plan.partition import format_partition
from kvmem.plan.planner import engine_geometry, plan
from kvmem.plan.types import EngineSettings, Layout, Plan, RankProfile
from kvmem.plan.vllm_log import VllmLog
from kvmem.plan.vllm_release import CHECK_FIRST_GROUP, CHECK_GLOBAL, VllmRelease
from kvmem.spec import ModelSpec, resolve_kv_dtype
from kvmem.units import GiB, format_bytes


@dataclass
class Row:
    """One figure as vLLM logged it and as kvmem computes it."""

    what: str
    logged: str
    kvmem: str
    verdict: str  # "match", or where and why they differ


@dataclass
class Better:
    """Something kvmem would do better, its figures and the command."""

    what: str
    figures: str
    command: str


@dataclass
class LogComparison:
    release: str
    deployment: str
    plan: Plan  # at the logged KV memory (the low end of its rounding)
    ranks: list[dict]
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    better: list[Better] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return all(r.verdict == "match" for r in self.rows)

    def to_dict(self) -> dict:
        return {"release": self.release, "deployment": self.deployment, "ranks": self.ranks,
                "rows": [vars(r) for r in self.rows], "notes": self.notes,
                "better": [vars(b) for b in self.better], "matches": self.matches,
                "plan": self.plan.to_dict()}


# ---------------------------------------------------------------------- the deployment
@dataclass
class _Deployment:
    release: VllmRelease
    layout: Layout
    settings: EngineSettings
    budgets: list[tuple[int, int]]  # each rank's KV memory: (low, high) bytes
    notes: list[str]


def _setting(log: VllmLog, key: str, config_key: str | None = None):
    value = log.args.get(key)
    if value is None and config_key:
        raw = log.config.get(config_key)
        value = int(raw) if raw is not None and raw.isdigit() else raw
    return value


def deployment(log: VllmLog, spec: ModelSpec, version: str | None) -> _Deployment:
    notes: list[str] = []
    if version is None and log.version is None:
        from kvmem.plan.vllm_release import DEFAULT_VERSION

        notes.append(f"the log names no vLLM version: vLLM {DEFAULT_VERSION}'s rules assumed")
    release = VllmRelease.parse(version or log.version or "0.33")
    if release.newer_than_known:
        notes.append(f"vLLM {release.name} is newer than the releases whose rules kvmem "
                     "read (0.9 to 0.33): 0.33's rules assumed")
    tp = _setting(log, "tensor_parallel_size", "tensor_parallel_size") or 1
    pp = _setting(log, "pipeline_parallel_size", "pipeline_parallel_size") or 1
    device = "cpu" if log.config.get("device_config") == "cpu" else "gpu"
    max_len = (log.max_model_len or _setting(log, "max_model_len", "max_seq_len")
               or spec.max_position_embeddings)
    if not isinstance(max_len, int):
        raise ConfigError("the log does not say max_model_len and the model's config has no "
                          "max_position_embeddings")
    block = _setting(log, "block_size")
    if block is None:
        block = vllm_cpu_defaults(spec, tp * pp)[0] if device == "cpu" else 16
        notes.append(f"block size {block}: vLLM's default on "
                     f"{'its CPU build' if device == 'cpu' else 'GPUs'} (the log does not "
                     "say)")
    batched = log.max_num_batched_tokens or _setting(log, "max_num_batched_tokens")
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
        gpu_memory_utilization=1.0, block_size=int(block), max_model_len=int(max_len),
        max_num_seqs=int(log.args.get("max_num_seqs") or 256),
        max_num_batched_tokens=int(batched), cuda_graphs=False, kv_cache_dtype=kv_dtype,
        vllm_version=release.name, device=device, max_concurrent_batches=batches,
        hybrid_kv_cache_manager=hybrid)
    layout = Layout(tensor_parallel_size=int(tp), pipeline_parallel_size=int(pp))
    return _Deployment(release, layout, settings, _budgets(log, tp * pp, tp, notes), notes)


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


def _budgets_from_size(log: VllmLog, spec: ModelSpec, d: _Deployment) -> list[tuple[int, int]]:
    """Without any worker's KV memory: the blocks the logged KV cache size stands for (the
    size grows with the blocks), as every rank's budget."""
    if not log.sizes:
        raise ConfigError("the log gives no worker's KV cache memory (\"Available KV cache "
                          "memory\"), no kv_cache_memory_bytes and no KV cache size: kvmem "
                          "cannot size it")
    tokens = log.sizes[0][2]
    probe = _plan(spec, d, [1] * d.layout.world_size)
    geometry = engine_geometry(spec, d.layout.tensor_parallel_size,
                               d.layout.pipeline_parallel_size, probe.settings,
                               probe.engine.kv_dtype)
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


def _plan(spec: ModelSpec, d: _Deployment, memory: list[int], policy: str = "uniform",
          **changes) -> Plan:
    layout = replace(d.layout, **{k: v for k, v in changes.items() if k == "layer_partition"})
    settings = replace(d.settings, **{k: v for k, v in changes.items()
                                      if k != "layer_partition"})
    return plan(spec, layout, settings, policy,
                profile=[RankProfile(0, 0, 0, 0, max(1, m)) for m in memory], suggest=False)


# ---------------------------------------------------------------------- comparison
def compare_log(log: VllmLog, spec: ModelSpec, model: str,
                version: str | None = None) -> LogComparison:
    """vLLM's logged figures beside kvmem's plan of the logged deployment (module doc)."""
    d = deployment(log, spec, version)
    if not d.budgets:
        d.budgets = _budgets_from_size(log, spec, d)
    low = _plan(spec, d, [b[0] for b in d.budgets])
    high = _plan(spec, d, [b[1] for b in d.budgets])
    s, e = low.settings, low.engine
    geometry = engine_geometry(spec, d.layout.tensor_parallel_size,
                               d.layout.pipeline_parallel_size, s, e.kv_dtype)
    notes = list(d.notes) + [n for n in low.notes if "vLLM's rules" in n]
    notes += [f"line {n}: a {what} line kvmem cannot read: {text}"
              for n, what, text in log.unreadable]
    deployment_text = (f"{model}, tp {d.layout.tensor_parallel_size} x pp "
                       f"{d.layout.pipeline_parallel_size} ({format_partition(e.layer_partition)}"
                       f" layers), max_model_len {e.max_model_len:,}, block {e.block_size}, "
                       f"{e.kv_dtype} KV, max_num_batched_tokens {s.max_num_batched_tokens:,}"
                       + (f" x {geometry.concurrent_batches} in flight"
                          if d.release.in_flight_batches else "")
                       + f", {geometry.num_groups} KV cache group"
                       f"{'s' if geometry.num_groups != 1 else ''}, {s.device.upper()}")
    result = LogComparison(f"vLLM {d.release.name}", deployment_text, low,
                           _rank_rows(low, high, d, geometry), [], notes)
    result.rows += _size_rows(log, low, high, geometry)
    if log.needed is not None:
        result.rows += _check_rows(log, low, high, geometry, d)
    for row in result.rows:
        if row.verdict != "match":
            row.verdict += _explain(log, spec, d, row)
    result.better = _better(log, spec, d, low, model)
    return result


def _gib(n: int) -> str:
    """GiB to two decimals, as vLLM logs them; with the bytes when that rounds away."""
    return f"{n / GiB:.2f} GiB" + (f" ({n:,} bytes)" if abs(n) < GiB // 10 else "")


def _span(lo: str, hi: str) -> str:
    return lo if lo == hi else f"{lo} to {hi}"


def _rank_rows(low: Plan, high: Plan, d: _Deployment, geometry) -> list[dict]:
    rows = []
    for r, h, budget in zip(low.ranks, high.ranks, d.budgets, strict=True):
        layers = r.layers
        need = geometry.check_need(layers, geometry.stage(layers), low.engine.max_model_len)
        rows.append({
            "rank": r.rank, "pp": r.pp_stage, "tp": r.tp_rank,
            "layers": f"{layers[0]}-{layers[-1]}" if layers else "-",
            "kv_memory": _span(format_bytes(budget[0]), format_bytes(budget[1])),
            "bytes_per_block": r.bytes_per_block,
            "blocks": _span(f"{r.num_blocks:,}", f"{h.num_blocks:,}"),
            "need": need, "held_back": geometry.held_back(geometry.stage(layers)),
            "per_rank_need": r.need_bytes_at_max_model_len, "fits": r.fits,
        })
    return rows


def _within(value: float, lo: float, hi: float) -> bool:
    return min(lo, hi) <= value <= max(lo, hi)


def _size_rows(log: VllmLog, low: Plan, high: Plan, geometry) -> list[Row]:
    """The logged KV cache size and concurrency (once, or per worker before 0.11.1)."""
    rows = []
    release = VllmRelease.parse(low.settings.vllm_version)
    per_worker = release.logs_per_worker and len(log.sizes) > 1
    for i, (_, _, tokens) in enumerate(log.sizes):
        figures = []
        for p in (low, high):
            if per_worker and i < len(p.ranks):
                rank = p.ranks[i]
                figures.append(geometry.kv_cache_size(rank.num_blocks, p.engine.max_model_len,
                                                      rank.layers))
            else:
                figures.append((p.engine.kv_cache_size_tokens, p.engine.max_concurrency))
        what = f"KV cache size (worker {i})" if per_worker else "KV cache size"
        lo, hi = figures[0][0], figures[1][0]
        rows.append(Row(what, f"{tokens:,} tokens", _span(f"{lo:,}", f"{hi:,}") + " tokens",
                        "match" if _within(tokens, lo, hi) else "differs"))
    for i, (_, length, value) in enumerate(log.concurrency):
        conc = [(p.ranks[i].num_blocks / geometry.blocks_per_request(length, p.ranks[i].layers)
                 if per_worker and i < len(p.ranks) else p.engine.max_concurrency)
                for p in (low, high)]
        lo, hi = f"{conc[0]:.2f}", f"{conc[1]:.2f}"
        ok = length == low.engine.max_model_len and _within(float(value), float(lo), float(hi))
        worker = f" (worker {i})" if per_worker else ""
        rows.append(Row(f"maximum concurrency at {length:,} tokens{worker}", f"{value}x",
                        _span(lo, hi) + "x", "match" if ok else "differs"))
    return rows


def _check_rows(log: VllmLog, low: Plan, high: Plan, geometry, d: _Deployment) -> list[Row]:
    """The start-up check: vLLM's need and memory beside the release's own rule on the
    rank it stopped at (the first that fails; from 0.14 to 0.16 the smallest memory)."""
    _, length, need_gib, avail_gib, estimate = log.needed
    check = d.release.fit_check
    failing = [r for r in low.ranks if not r.fits] or low.ranks[:1]
    rank = min(low.ranks, key=lambda r: r.kv_budget_bytes) if check == CHECK_GLOBAL \
        else failing[0]
    kv = geometry.stage(rank.layers)
    need = geometry.check_need(rank.layers, kv, length)
    avail = [p.ranks[rank.rank].kv_budget_bytes - geometry.held_back(kv) for p in (low, high)]
    rows = [
        Row(f"KV cache needed for max_model_len {length:,} (rank {rank.rank})",
            f"{need_gib:.2f} GiB", _gib(need),
            "match" if round(need / GiB, 2) == round(need_gib, 2) else "differs"),
        Row(f"available KV cache memory (rank {rank.rank})", f"{avail_gib:.2f} GiB",
            _span(_gib(avail[0]), _gib(avail[1])),
            "match" if _within(avail_gib, round(avail[0] / GiB, 2), round(avail[1] / GiB, 2))
            else "differs"),
    ]
    if estimate is not None:
        longest = [min(p.ranks[rank.rank].max_model_len_that_fits, length) for p in (low, high)]
        rows.append(Row("estimated maximum model length", f"{estimate:,}",
                        _span(f"{longest[0]:,}", f"{longest[1]:,}"),
                        "match" if _within(estimate, *longest) else "differs"))
    return rows


def _explain(log: VllmLog, spec: ModelSpec, d: _Deployment, row: Row) -> str:
    """Which unstated setting, varied, makes kvmem's figure vLLM's (or that none does)."""
    memory = [b[0] for b in d.budgets]
    if row.what.startswith("KV cache needed"):
        return _explain_need(log, spec, d, memory)
    tries: list[tuple[str, dict]] = []
    if "max_num_batched_tokens" not in log.args and log.max_num_batched_tokens is None:
        tries += [(f"max_num_batched_tokens {b}", {"max_num_batched_tokens": b})
                  for b in (2048, 4096, 8192, 16384)]
    if "block_size" not in log.args:
        tries += [(f"block size {b}", {"block_size": b}) for b in (16, 32, 64, 128)]
    if d.release.in_flight_batches:
        tries += [(f"{n} batches in flight (asynchronous scheduling "
                   f"{'on' if n > d.layout.pipeline_parallel_size else 'off'})",
                   {"max_concurrent_batches": n})
                  for n in sorted({1, 2, d.layout.pipeline_parallel_size,
                                   d.layout.pipeline_parallel_size + 1})]
    tries.append(("the hybrid KV cache manager off", {"hybrid_kv_cache_manager": False}))
    for what, change in tries:
        try:
            p = _plan(spec, d, memory, **change)
        except ConfigError:
            continue
        if _agrees(log, p, row):
            return f": vLLM's figure follows with {what} (the log does not say)"
    return ": no unstated setting explains it"


def _explain_need(log: VllmLog, spec: ModelSpec, d: _Deployment, memory: list[int]) -> str:
    """A logged need that is a whole multiple of a rank's own: what it counted."""
    need_gib = log.needed[2]
    per_rank = _plan(spec, d, memory, vllm_version="0.33")
    need = max(r.need_bytes_at_max_model_len - r.bytes_per_block for r in per_rank.ranks)
    tp, pp = d.layout.tensor_parallel_size, d.layout.pipeline_parallel_size
    for factor, what in ((tp * pp, f"all {tp * pp} ranks'"), (pp, f"all {pp} stages'"),
                         (tp, f"all {tp} tensor-parallel ranks'")):
        # within 0.1%: the logged figure is rounded, and a config may differ slightly
        if factor > 1 and abs(factor * need / GiB - need_gib) <= 0.001 * need_gib:
            return (f": vLLM's figure is {what} KV for one request ({factor} x the "
                    f"{format_bytes(need)} one rank needs), compared with one rank's memory")
    return ": no unstated setting explains it"


def _agrees(log: VllmLog, p: Plan, row: Row) -> bool:
    e = p.engine
    if row.what.startswith("KV cache size"):
        return any(t == e.kv_cache_size_tokens for _, _, t in log.sizes)
    if row.what.startswith("maximum concurrency"):
        return any(v == f"{e.max_concurrency:.2f}" for _, _, v in log.concurrency)
    return False


# ---------------------------------------------------------------------- better
def _command(log: VllmLog, model: str, d: _Deployment, env: dict[str, str] | None = None,
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
    argv.update({k.replace("_", "-"): v for k, v in flags.items()})
    words = [f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    words += ["vllm", "serve", shlex.quote(model)]
    for key, value in argv.items():
        if value is not None:
            words += [f"--{key}", shlex.quote(str(value))]
    return " ".join(words)


def _better(log: VllmLog, spec: ModelSpec, d: _Deployment, base: Plan,
            model: str) -> list[Better]:
    memory = [b[0] for b in d.budgets]
    e, out = base.engine, []
    if not e.fits:
        out += _what_starts(log, spec, d, base, model)
    if d.layout.pipeline_parallel_size > 1:
        for policy in ("proportional", "optimal"):
            p = _plan(spec, d, memory, policy)
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
        p = _plan(spec, d, memory, kv_cache_dtype="fp8")
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


def _what_starts(log: VllmLog, spec: ModelSpec, d: _Deployment, base: Plan,
                 model: str) -> list[Better]:
    """For a failed start: the per-rank need, and deployments that start."""
    out = []
    per_rank = _plan(spec, d, [b[0] for b in d.budgets],
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
