"""``kvmem top``: engines sharing elastic KV memory on this machine, from the ledgers."""

from __future__ import annotations

import argparse
import json
import time

MAX_WATCH_S = 86400.0  # a day


def _interval(text: str) -> float:
    """``--watch``'s SECONDS: a number from 0.1 to a day (not inf, nan or negative)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= seconds <= MAX_WATCH_S:  # nan fails too
        raise argparse.ArgumentTypeError(f"SECONDS must be from 0.1 to {MAX_WATCH_S:g}, "
                                         f"got {text!r}")
    return seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--watch", type=_interval, metavar="SECONDS", default=None,
                   help=f"refresh every SECONDS (0.1 to {MAX_WATCH_S:g}) until interrupted")
    p.add_argument("--ledger-dir", default=None,
                   help="where the ledgers live (default $KVMEM_LEDGER_DIR or /dev/shm)")


def _rows(ledger_dir: str | None) -> list[dict]:
    from kvmem.memory.ledger import Ledger

    rows = []
    for ledger in Ledger.all(ledger_dir):
        total = ledger.total_limit()
        for e in ledger.entries():
            rows.append({"name": e.name, "pid": e.pid, "device": ledger.device,
                         "mapped_bytes": e.mapped_bytes, "used_bytes": e.used_bytes,
                         "limit_bytes": e.limit_bytes, "device_limit_bytes": total,
                         "heartbeat_age_s": round(max(0.0, time.time() - e.heartbeat), 1)})
    return rows


def _table(rows: list[dict]):  # -> rich.table.Table
    from rich.table import Table

    from kvmem.units import format_bytes

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    table = Table(title="kvmem elastic KV memory")
    for col in ("engine", "pid", "device", "mapped", "used", "used/mapped", "limit",
                "device limit", "heartbeat"):
        table.add_column(col, justify="left" if col in ("engine", "device") else "right")
    for r in rows:
        ratio = f"{r['used_bytes'] / r['mapped_bytes']:.0%}" if r["mapped_bytes"] else "-"
        table.add_row(r["name"], str(r["pid"]), r["device"], size(r["mapped_bytes"]),
                      size(r["used_bytes"]), ratio, size(r["limit_bytes"]),
                      size(r["device_limit_bytes"]), f"{r['heartbeat_age_s']:.1f} s ago")
    return table


def run(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(_rows(args.ledger_dir), indent=1))
        return 0
    from rich.console import Console

    console = Console()
    if args.watch is None:
        rows = _rows(args.ledger_dir)
        console.print(_table(rows) if rows else "no engines use elastic KV memory")
        return 0
    from rich.live import Live

    with Live(_table(_rows(args.ledger_dir)), console=console) as live:
        while True:
            time.sleep(args.watch)
            live.update(_table(_rows(args.ledger_dir)))
