"""``kvmem models``: the bundled catalog as a table (or JSON).

The table shows every model id in full with its aliases beneath it (the names
``kvmem plan`` also accepts); when the terminal is narrower than the widest id, the table
is drawn wider rather than cutting ids.
"""

from __future__ import annotations

import argparse
import json
import textwrap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _rows() -> list[dict]:
    from kvmem.spec import catalog, load_spec

    rows = []
    for entry in catalog():
        spec = load_spec(entry.hf_id)
        kinds = sorted({layer.kind.value for layer in spec.layers})
        rows.append({
            "id": entry.hf_id, "aliases": list(entry.aliases), "layers": spec.num_layers,
            "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "attention": kinds,
            "kv_bytes_per_token_bf16": spec.kv_bytes_per_token(dtype_bytes=2),
            "source_quality": entry.source_quality,
        })
    return rows


def _model_cell(row: dict, width: int) -> str:
    """The id, then its aliases wrapped to the id column's width (dimmed)."""
    if not row["aliases"]:
        return row["id"]
    aliases = textwrap.wrap(", ".join(row["aliases"]), width, break_on_hyphens=False)
    return row["id"] + "".join(f"\n[dim]{line}[/dim]" for line in aliases)


def _table(rows: list[dict]):
    from rich import box
    from rich.table import Table

    width = max(len(r["id"]) for r in rows)
    table = Table(title=f"kvmem model catalog ({len(rows)} models; aliases dimmed)",
                  box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    table.add_column("model / aliases", min_width=width, overflow="fold")
    for col in ("layers", "KV\nheads", "head\ndim"):
        table.add_column(col, justify="right")
    table.add_column("attn")
    table.add_column("B/token\n(bf16)", justify="right")
    for r in rows:
        kinds = "\n".join(k.removesuffix("_attention") for k in r["attention"])
        table.add_row(_model_cell(r, width), str(r["layers"]), str(r["kv_heads"]),
                      str(r["head_dim"]), kinds, f"{r['kv_bytes_per_token_bf16']:,}")
    return table


def run(args: argparse.Namespace) -> int:
    rows = _rows()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console

    table = _table(rows)
    console = Console()
    needed = Console(width=1 << 12).measure(table).minimum
    if needed > console.width:  # never cut a model id: draw wider than the terminal
        console = Console(width=needed)
    console.print(table)
    return 0
