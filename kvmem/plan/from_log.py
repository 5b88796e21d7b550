"""A vLLM start-up log against kvmem's plan of the same deployment.

``compare_log(log, spec, model)`` plans the deployment the log describes
(``kvmem.plan.log_deployment``) under that release's rules (``kvmem.plan.vllm_rules``)
and sets vLLM's figures beside kvmem's: per rank, and for the engine (KV cache size,
maximum concurrency, the start-up check's need, memory and estimate). A figure vLLM
logged rounded (GiB to two decimals) is compared with kvmem's figures at both ends of its
rounding interval. Where a figure differs, the settings the log does not state are varied
to say which value explains it. Then what kvmem would do better
(``kvmem.plan.log_advice``), and what the log states beside the figures
(``logged_settings``: a hybrid model's raised attention block size and padded Mamba page,
a speculative decoder, each KV cache size and concurrency line). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.errors import ConfigError
from kvmem.plan.log_advice import Better, better
from kvmem.plan.log_deployment import Deployment, deployment, logged_geometry, plan_logged
from kvmem.plan.partition import format_partition
from kvmem.plan.types import Plan
from kvmem.plan.vllm_log import VllmLog
from kvmem.plan.vllm_release import CHECK_GLOBAL, VllmRelease
from kvmem.spec import ModelSpec
from kvmem.units import GiB, format_bytes


@dataclass
class Row:
    """One figure as vLLM logged it and as kvmem computes it."""

    what: str
    logged: str
    kvmem: str
    verdict: str  # "match", or where and why they differ


@dataclass
class LogComparison:
    release: str
    deployment: str
    plan: Plan  # at the logged KV memory (the low end of its rounding)
    ranks: list[dict]
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    better: list[Better] = field(default_factory=list)
    lines: tuple[int, int] = (1, 0)  # the log lines of this engine
    logged: dict = field(default_factory=dict)  # hybrid and speculative settings as logged

    @property
    def matches(self) -> bool:
        return all(r.verdict == "match" for r in self.rows)

    def to_dict(self) -> dict:
        return {"release": self.release, "deployment": self.deployment,
                "lines": list(self.lines), "logged": self.logged, "ranks": self.ranks,
                "rows": [vars(r) for r in self.rows], "notes": self.notes,
                "better": [vars(b) for b in self.better], "matches": self.matches,
                "plan": self.plan.to_dict()}


# ---------------------------------------------------------------------- comparison
def compare_log(log: VllmLog, spec: ModelSpec, model: str,
                version: str | None = None) -> LogComparison:
    """vLLM's logged figures beside kvmem's plan of the logged deployment (module doc)."""
    d = deployment(log, spec, version)
    low = plan_logged(spec, d, [b[0] for b in d.budgets])
    high = plan_logged(spec, d, [b[1] for b in d.budgets])
    s, e = low.settings, low.engine
    geometry = logged_geometry(spec, d, low)
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
    result.rows += _state_page_rows(log, low, geometry)
    result.rows += _size_rows(log, low, high, geometry)
    if log.needed is not None:
        result.rows += _check_rows(log, low, high, geometry, d)
    for row in result.rows:
        if row.verdict != "match":
            row.verdict += _explain(log, spec, d, row)
    result.better = better(log, spec, d, low, model)
    result.lines, result.logged = log.lines, logged_settings(log)
    return result


def logged_settings(log: VllmLog) -> dict:
    """What the log says of a hybrid model's pages, a speculative decoder and its KV cache
    size lines, as logged (with their line numbers)."""
    out: dict = {}
    if log.attention_block_size is not None:
        line, tokens, why = log.attention_block_size
        out["attention_block_size"] = {"line": line, "tokens": tokens, "why": why}
    if log.mamba_padding is not None:
        line, percent = log.mamba_padding
        out["mamba_page_padding"] = {"line": line, "percent": percent}
    spec = log.speculative or log.args.get("speculative_config")
    if isinstance(spec, dict) and spec:
        tokens = spec.get("num_spec_tokens", spec.get("num_speculative_tokens"))
        out["speculative"] = {"method": spec.get("method"), "model": spec.get("model"),
                              "num_speculative_tokens": tokens}
    out["kv_cache_size"] = [{"line": n, "device": device, "tokens": tokens}
                            for n, device, tokens in log.sizes]
    out["maximum_concurrency"] = [{"line": n, "max_model_len": length, "concurrency": value}
                                  for n, length, value in log.concurrency]
    return out


def _gib(n: int) -> str:
    """GiB to two decimals, as vLLM logs them; with the bytes when that rounds away."""
    return f"{n / GiB:.2f} GiB" + (f" ({n:,} bytes)" if abs(n) < GiB // 10 else "")


def _span(lo: str, hi: str) -> str:
    return lo if lo == hi else f"{lo} to {hi}"


def _rank_rows(low: Plan, high: Plan, d: Deployment, geometry) -> list[dict]:
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


def _state_page_rows(log: VllmLog, low: Plan, geometry) -> list[Row]:
    """The attention block size vLLM raised for a hybrid model's states, and how much it
    padded the state page, beside the release's own rule."""
    rows = []
    mamba = getattr(geometry, "mamba", None)
    if log.attention_block_size is not None:
        _, tokens, _ = log.attention_block_size
        block = low.engine.block_size
        rows.append(Row("attention block size (raised for the states)", f"{tokens:,} tokens",
                        f"{block:,} tokens", "match" if block == tokens else "differs"))
    if log.mamba_padding is not None:
        _, percent = log.mamba_padding
        padding = f"{mamba.padding:.2f}%" if mamba is not None else "no state page"
        rows.append(Row("state page padding", f"{percent}%", padding,
                        "match" if padding == f"{percent}%" else "differs"))
    return rows


def _check_rows(log: VllmLog, low: Plan, high: Plan, geometry, d: Deployment) -> list[Row]:
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


def _explain(log: VllmLog, spec: ModelSpec, d: Deployment, row: Row) -> str:
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
            p = plan_logged(spec, d, memory, **change)
        except ConfigError:
            continue
        if _agrees(log, p, row):
            return f": vLLM's figure follows with {what} (the log does not say)"
    return ": no unstated setting explains it"


def _explain_need(log: VllmLog, spec: ModelSpec, d: Deployment, memory: list[int]) -> str:
    """A logged need that is a whole multiple of a rank's own: what it counted."""
    need_gib = log.needed[2]
    per_rank = plan_logged(spec, d, memory, vllm_version="0.33")
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
