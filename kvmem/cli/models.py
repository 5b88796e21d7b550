"""``kvmem models``: the bundled catalog as a table (or JSON).

The table shows every model id in full with its aliases beneath it (the names
``kvmem plan`` also accepts); when the terminal is narrower than the widest id, the table
is drawn wider rather than cutting ids. Models whose attention kind kvmem cannot plan yet
close the table with that kind in place of their KV sizes.
"""

from __future__ import annotations

import argparse
import json
import textwrap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _rows() -> list[dict]:
    from kvmem.spec import catalog, load_spec, text_config
    from kvmem.spec.catalog import unplanned

    rows = []
    for entry in catalog():
        spec = load_spec(entry.hf_id)
        kinds = sorted({layer.kind.value for layer in spec.layers})
        rows.append({
            "id": entry.hf_id, "aliases": list(entry.aliases), "layers": spec.num_layers,
            "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "attention": kinds,
            "kv_bytes_per_token_bf16": spec.kv_bytes_per_token(dtype_bytes=2),
            "source_quality": entry.source_quality, "unplanned": None,
        })
    for entry in unplanned():
        cfg = text_config(entry.config)
        rows.append({
            "id": entry.hf_id, "aliases": list(entry.aliases),
            "layers": cfg.get("num_hidden_layers"), "kv_heads": cfg.get("num_key_value_heads"),
            "head_dim": cfg.get("head_dim"), "attention": [], "kv_bytes_per_token_bf16": None,
            "source_quality": entry.source_quality, "unplanned": entry.unplanned,
        })
    return rows


def _model_cell(row: dict, width: int) -> str:
    """The id, then its aliases (and why it is not planned, if so) wrapped to the id
    column's width (dimmed)."""
    texts = [", ".join(row["aliases"])]
    if row["unplanned"] is not None:
        texts.append(f"not planned yet: {row['unplanned']}")
    lines = [line for text in texts if text
             for line in textwrap.wrap(text, width, break_on_hyphens=False)]
    return row["id"] + "".join(f"\n[dim]{line}[/dim]" for line in lines)


def _table(rows: list[dict]):
    from rich import box
    from rich.table import Table

    width = max(len(r["id"]) for r in rows)
    waiting = sum(r["unplanned"] is not None for r in rows)
    title = f"kvmem model catalog ({len(rows) - waiting} models planned"
    if waiting:
        title += f", {waiting} not planned yet"
    table = Table(title=f"{title}; aliases dimmed)",
                  box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    table.add_column("model / aliases", min_width=width, overflow="fold")
    for col in ("layers", "KV\nheads", "head\ndim"):
        table.add_column(col, justify="right")
    table.add_column("attn")
    table.add_column("B/token\n(bf16)", justify="right")
    for r in rows:
        if r["unplanned"] is not None:
            kinds, per_token = "-", "-"
        else:
            kinds = "\n".join(k.removesuffix("_attention") for k in r["attention"])
            per_token = f"{r['kv_bytes_per_token_bf16']:,}"
        sizes = (r["layers"], r["kv_heads"], r["head_dim"])
        table.add_row(_model_cell(r, width), *("-" if n is None else str(n) for n in sizes),
                      kinds, per_token)
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
