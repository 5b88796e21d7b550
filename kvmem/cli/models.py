"""``kvmem models``: the bundled catalog as a table (or JSON)."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
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
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvmem model catalog ({len(rows)} models)")
    for col in ("model", "layers", "KV heads", "head_dim", "attention", "KV/token (bf16)"):
        table.add_column(col, justify="left" if col in ("model", "attention") else "right")
    for r in rows:
        table.add_row(r["id"], str(r["layers"]), str(r["kv_heads"]), str(r["head_dim"]),
                      ", ".join(r["attention"]), f"{r['kv_bytes_per_token_bf16']:,} B")
    Console().print(table)
    return 0
