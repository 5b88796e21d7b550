"""A plan as tables a person reads: per-rank memory, the engine summary, engine flags."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from kvmem.plan.flags import EngineCommand
from kvmem.plan.types import Plan, RankPlan
from kvmem.units import GiB


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _layers(r: RankPlan) -> str:
    return f"{r.layers[0]}-{r.layers[-1]}" if r.layers else "-"


def rank_table(plan: Plan) -> Table:
    e = plan.engine
    table = Table(title=f"{plan.model}: KV cache per rank ({e.policy} budget, {e.kv_dtype}, "
                        f"block {e.block_size}, {e.rules}'s rules); memory columns in GiB",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    for col in ("rank", "pp", "tp", "layers", "memory", "weights", "act", "graphs", "other",
                "KV", "KV B/tok", "blocks", "tokens", "fits"):
        table.add_column(col, justify="left" if col in ("layers", "fits") else "right",
                         no_wrap=True)
    for r in plan.ranks:
        table.add_row(
            str(r.rank), str(r.pp_stage), str(r.tp_rank), _layers(r), _gib(r.memory_bytes),
            _gib(r.weights_bytes), _gib(r.activation_bytes), _gib(r.cuda_graph_bytes),
            _gib(r.non_torch_bytes), _gib(r.kv_budget_bytes), f"{r.kv_bytes_per_token:,}",
            f"{r.num_blocks:,}", f"{r.tokens:,}",
            "[green]yes[/]" if r.fits else "[red]no[/]",
        )
    return table


def summary_lines(plan: Plan) -> list[str]:
    e = plan.engine
    verdict = "[green]fits[/]" if e.fits else "[red]does not fit[/]"
    return [
        f"engine blocks      {e.num_blocks:,} (minimum over ranks)",
        f"engine tokens      {e.tokens:,} (the blocks' tokens, {_token_groups(plan)})",
        f"KV cache size      {e.kv_cache_size_tokens:,} tokens (as {e.rules} reports it)",
        f"concurrency        {e.max_concurrency:.2f}x requests of {e.max_model_len:,} tokens",
        f"max_model_len      {e.max_model_len:,}: {verdict}",
        f"longest that fits  {e.max_model_len_that_fits:,}",
        f"layer partition    {','.join(map(str, e.layer_partition))}",
        f"KV budget policy   {e.policy}",
    ]


def print_plan(plan: Plan, command: EngineCommand | None = None,
               plot: str | None = None, console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 200)
    console.print(rank_table(plan))
    for line in summary_lines(plan):
        console.print(line, highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    if not plan.engine.fits:
        from kvmem.plan.types import FitError

        try:
            plan.check_fit()
        except FitError as err:
            console.print(f"[red]{err}[/]", highlight=False)
    if command is not None:
        console.print(f"\n{command.engine} command:")
        console.print(command.shell(), markup=False, soft_wrap=True)
        for note in command.notes:
            console.print(f"note: {note}", highlight=False)
        if command.plugin is not None:
            console.print(f"\n{command.engine} command with kvmem's plugin (per-rank budgets):")
            console.print(command.plugin.shell(), markup=False, soft_wrap=True)
    if plot:
        console.print(f"plot saved to {plot}")


def _token_groups(plan: Plan) -> str:
    """Which groups share the blocks' tokens (state groups hold states, not tokens)."""
    e = plan.engine
    shared = e.num_kv_groups - e.num_state_groups
    text = f"shared over {shared} KV group{'s' if shared != 1 else ''}"
    if e.num_state_groups:
        held = "up to two blocks" if plan.settings.enable_prefix_caching else "one block"
        text += f"; {e.num_state_groups} state groups hold {held} a request each"
    return text
