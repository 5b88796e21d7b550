"""What the page draws for one plan, in the CLI's own words and figures.

The page shows, beside `kvmem plan --json`'s document: each rank's memory as the stacked
bar `--plot` draws (``kvmem.plan.plot.rank_segments``), the per-rank table, the engine
summary lines of the table output, vLLM's KV size and concurrency as vLLM logs them, the
engine commands as the CLI prints them (shell-quoted, ready to paste), and every warning
the CLI prints. Nothing here plans: it formats a ``kvmem.plan.invocation.PlanRun``.
"""

from __future__ import annotations

import json
import re

from rich.text import Text

from kvmem.plan.invocation import PlanRun, elastic_lines
from kvmem.plan.plot import PARTS, rank_segments
from kvmem.plan.report import summary_lines
from kvmem.plan.types import FitError
from kvmem.ui.query import run_query
from kvmem.units import GiB, format_bytes

FREE_COLOR = "#e5e5e5"  # as in the plot
_SUMMARY = re.compile(r"^(\S+(?: \S+)*?)\s{2,}(.*)$")  # "engine blocks      2,925 (...)"


def bars(run: PlanRun) -> dict:
    """Each rank's memory in GiB per part, the parts in the plot's order and colours, and
    its device memory (where known: weights alone may exceed it)."""
    parts = [{"label": label, "color": color} for label, _, color in PARTS]
    parts.append({"label": "free", "color": FREE_COLOR})
    ranks = [{"label": f"r{r.rank} pp{r.pp_stage}/tp{r.tp_rank}",
              "gib": [round(row[p["label"]], 3) for p in parts],
              "memory_gib": None if r.memory_bytes is None else round(r.memory_bytes / GiB, 3)}
             for r, row in zip(run.plan.ranks, rank_segments(run.plan), strict=True)]
    return {"parts": parts, "ranks": ranks}


def rank_rows(run: PlanRun) -> list[dict]:
    return [{"rank": r.rank, "pp_stage": r.pp_stage, "tp_rank": r.tp_rank,
             "layers": f"{r.layers[0]}-{r.layers[-1]}" if r.layers else "-",
             "blocks": r.num_blocks, "tokens": r.tokens, "fits": r.fits,
             "need": format_bytes(r.need_bytes_at_max_model_len),
             "budget": format_bytes(r.kv_budget_bytes),
             "longest": r.max_model_len_that_fits}
            for r in run.plan.ranks]


def summary(run: PlanRun) -> list[list[str]]:
    """The table output's engine summary as (label, value) pairs."""
    pairs = []
    for line in summary_lines(run.plan):
        plain = Text.from_markup(line).plain
        m = _SUMMARY.match(plain)
        pairs.append([m.group(1), m.group(2)] if m else [plain, ""])
    return pairs


def vllm_log(run: PlanRun, device: str) -> str:
    """vLLM's start-up lines for this plan's KV cache (``device``: gpu or cpu) in the form
    vLLM 0.30 and later log them, with the figures of the release ``--vllm-version`` names:
    the speculative config of its engine config line, the attention block size it raises
    for linear-attention states, and the KV cache size and concurrency."""
    e, s = run.plan.engine, run.plan.settings
    lines = []
    if s.speculative_config is not None:
        spec = json.loads(s.speculative_config)
        # vLLM names the target itself as an MTP draft, and no model for n-gram or suffix
        model = run.plan.model if spec["method"] == "mtp" else spec.get("model")
        lines.append(f"speculative_config=SpeculativeConfig(method={spec['method']!r}, "
                     f"model={model!r}, num_spec_tokens={spec.get('num_speculative_tokens')})")
    if e.block_size > s.block_size:  # only for linear-attention states, under vLLM's rules
        lines.append(f"Setting attention block size to {e.block_size} tokens to ensure that "
                     "attention page size is >= mamba page size.")
    lines.append(f"{device.upper()} KV cache size: {e.kv_cache_size_tokens:,} tokens, Maximum "
                 f"concurrency for {e.max_model_len:,} tokens per request: "
                 f"{e.max_concurrency:.2f}x")
    return "\n".join(lines)


def commands(run: PlanRun) -> list[dict]:
    cmd = run.command
    if cmd is None:
        return []
    out = [{"title": f"{cmd.engine} command", "shell": cmd.shell(), "notes": list(cmd.notes)}]
    if cmd.plugin is not None:
        out.append({"title": f"{cmd.engine} command with kvmem's plugin (per-rank budgets)",
                    "shell": cmd.plugin.shell(), "notes": list(cmd.plugin.notes)})
    return out


def warnings(run: PlanRun) -> list[str]:
    """Every note the table output prints, then the fit error it prints in red."""
    out = [*run.plan.notes, *run.offload_notes()]
    try:
        run.plan.check_fit()
    except FitError as err:
        out.append(str(err))
    return out


def page_view(run: PlanRun, device: str) -> dict:
    e = run.plan.engine
    return {
        "plan": run.document(),
        "fits": e.fits,
        "bars": bars(run),
        "ranks": rank_rows(run),
        "summary": summary(run),
        "vllm_log": vllm_log(run, device),
        "elastic": (elastic_lines(run.elastic, on_cpu=device == "cpu",
                                   huge_pages=run.huge_pages)
                    if run.elastic is not None else []),
        "commands": commands(run),
        "warnings": warnings(run),
        "alternatives": list(run.plan.alternatives),
    }


def plan_document(query: str) -> dict:
    """``/api/plan``: `kvmem plan --json`'s document for the flags in ``query``."""
    return run_query(query)[1].document()


def plan_page(query: str) -> dict:
    """``/api/view``: the same document with what the page draws."""
    args, run = run_query(query)
    return page_view(run, args.device)


ENDPOINTS = {"plan": plan_document, "view": plan_page}
