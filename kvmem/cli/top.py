"""``kvmem top``: engines sharing elastic KV memory on this machine, from the ledgers:
per engine its floor, ceiling, what it may hold now, mapped, live and cached bytes, what it
gave back to others and what it waits for (``kvmem.memory.control``); ``--json`` prints
``control.document``, a stable, versioned form."""

from __future__ import annotations

import argparse
import json
import time

MAX_WATCH_S = 86400.0  # a day
STALE_S = 5.0  # heartbeats come every 0.25 s


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


def _views(ledger_dir: str | None) -> list:
    from kvmem.memory import control

    return control.devices(ledger_dir)


def _render(views: list):  # -> a rich renderable
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def size(n: int | None) -> str:  # short: eleven columns fit 80 characters
        if n is None:
            return "-"
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if n >= 1 << shift:
                return f"{n / (1 << shift):.1f}{unit}"
        return f"{n}B"

    table = Table(title="kvmem elastic KV memory", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("engine", "pid", "device", "floor", "ceiling", "mapped", "live", "cached",
                "given", "waits", "idle"):
        table.add_column(col, justify="left" if col in ("engine", "device") else "right",
                         no_wrap=True)
    notes = []
    for v in views:
        if v.error:
            notes.append(Text(f"{v.device}: {v.error}", style="red"))
            continue
        if v.damage:
            notes.append(Text(f"{v.device}: the ledger {v.ledger} is damaged ("
                              f"{'; '.join(v.damage[:3])}); engines keep their own "
                              "accounting and the next write repairs it", style="yellow"))
        if v.total_bytes is not None:
            notes.append(Text(f"{v.device}: total {size(v.total_bytes)}, held "
                              f"{size(v.held_bytes)}, counted {size(v.reserved_bytes)} "
                              "(floors included)"))
        for e in v.engines:
            given = f"{size(e.reclaimed_bytes)}/{e.reclaims}" if e.reclaims else "-"
            # names are shown as text, never as rich markup
            table.add_row(Text(e.name), str(e.pid), Text(v.device), size(e.floor_bytes),
                          size(e.ceiling_bytes), size(e.mapped_bytes), size(e.live_bytes),
                          size(e.cached_bytes), given,
                          size(e.wanted_bytes) if e.wanted_bytes else "-", f"{e.idle_s:.0f} s")
            if e.heartbeat_age_s > STALE_S:
                notes.append(Text(f"{e.name}: no heartbeat for {e.heartbeat_age_s:.0f} s "
                                  "(stopped or stuck)", style="yellow"))
    if not table.row_count:
        return Group(Text("no engines use elastic KV memory"), *notes)
    return Group(table, *notes)


def run(args: argparse.Namespace) -> int:
    from kvmem.memory import control

    if args.json:
        print(json.dumps(control.document(_views(args.ledger_dir)), indent=1))
        return 0
    from rich.console import Console

    # never narrower than the table: a cut name could not be given to `kvmem limit`
    console = Console()
    wide = console.options.update(max_width=400)
    console = Console(width=max(console.width, console.measure(
        _render(_views(args.ledger_dir)), options=wide).maximum))
    if args.watch is None:
        console.print(_render(_views(args.ledger_dir)))
        return 0
    from rich.live import Live

    with Live(_render(_views(args.ledger_dir)), console=console) as live:
        while True:
            time.sleep(args.watch)
            live.update(_render(_views(args.ledger_dir)))
