"""A vLLM log beside kvmem's plan, as tables a person reads (``kvmem plan --from-vllm-log``).

Everything taken from the log (the model's name, the logged figures) is printed as plain
text: square brackets in it are never read as rich markup."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvmem.plan.from_log import LogComparison
from kvmem.units import format_bytes


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A closed pipe is the caller's to end (``kvmem.cli.output``), not an exit here."""
        self.quiet = True
        raise BrokenPipeError


def _plain(*cells: str) -> list[Text]:
    return [Text(cell) for cell in cells]


def logged_lines(logged: dict) -> list[str]:
    """The hybrid-page and speculative-decoding settings the log states, one line each."""
    out = []
    block, padding = logged.get("attention_block_size"), logged.get("mamba_page_padding")
    if block:
        out.append(f"vLLM raised the attention block size to {block['tokens']:,} tokens "
                   f"{block['why']} (line {block['line']})".replace("  ", " "))
    if padding:
        out.append(f"vLLM padded the Mamba state page by {padding['percent']}% to the "
                   f"attention page's size (line {padding['line']})")
    spec = logged.get("speculative")
    if spec:
        tokens = spec["num_speculative_tokens"]
        out.append(f"speculative decoding: {spec['method'] or 'method not logged'}"
                   + (f", {tokens} speculative tokens" if tokens is not None else "")
                   + (f", draft model {spec['model']}" if spec["model"] else ""))
    return out


def print_comparison(result: LogComparison, console: Console | None = None) -> None:
    console = console or _Console(width=None if Console().is_terminal else 200)
    console.print(f"{result.release} log: {result.deployment}", highlight=False, markup=False)
    for line in logged_lines(result.logged):
        console.print(line, highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    ranks = _table(f"per rank: the KV memory vLLM logged; blocks and need by "
                   f"{result.release}'s rules",
                   ["rank", "pp", "tp", "layers", "KV memory", "bytes/block", "blocks",
                    "need (vLLM's check)", "fits"])
    for r in result.ranks:
        held = f" + {format_bytes(r['held_back'])} null block" if r["held_back"] else ""
        ranks.add_row(*_plain(str(r["rank"]), str(r["pp"]), str(r["tp"]), r["layers"],
                              r["kv_memory"], f"{r['bytes_per_block']:,}", r["blocks"],
                              f"{format_bytes(r['need'])}{held}"),
                      Text("yes", "green") if r["fits"] else Text("no", "red"))
    console.print(ranks)
    rows = _table("vLLM logged, kvmem computes", ["figure", "vLLM logged", "kvmem", "verdict"])
    for row in result.rows:
        verdict = Text(row.verdict, "green" if row.verdict == "match" else "")
        rows.add_row(*_plain(row.what, row.logged, row.kvmem), verdict)
    if result.rows:
        console.print(rows)
    else:
        console.print("the log has no KV cache size, concurrency or fit check line to compare",
                      highlight=False)
    if result.better:
        console.print("\nwhat kvmem would do:", highlight=False)
    for b in result.better:
        console.print(f"- {b.what}: {b.figures}", highlight=False, markup=False)
        if b.command:
            console.print(f"  {b.command}", highlight=False, markup=False, soft_wrap=True)
