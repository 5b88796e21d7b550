"""``kvmem top``: engines sharing elastic KV memory on this machine, from the ledgers;
with ``--metrics URL``, also the offload tiers of those servers (their ``/metrics``)."""

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
    p.add_argument("--metrics", type=_metrics_url, action="append", default=[],
                   metavar="URL", help="also show the offload tiers of the server whose "
                   "/metrics is at URL (vLLM with KvmemConnector, or kvmem serve); repeatable")


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
        rows = _rows(args.ledger_dir)
        print(json.dumps({"engines": rows, "tiers": _tier_rows(args.metrics)} if args.metrics
                         else rows, indent=1))
        return 0
    from rich.console import Console

    console = Console()
    if args.watch is None:
        rows = _rows(args.ledger_dir)
        console.print(_table(rows) if rows else "no engines use elastic KV memory")
        if args.metrics:
            console.print(_tiers_table(_tier_rows(args.metrics)))
        return 0
    from rich.live import Live

    def screen():  # -> a rich renderable
        from rich.console import Group

        elastic = _table(_rows(args.ledger_dir))
        return Group(elastic, _tiers_table(_tier_rows(args.metrics))) if args.metrics \
            else elastic

    with Live(screen(), console=console) as live:
        while True:
            time.sleep(args.watch)
            live.update(screen())


# -- offload tiers (--metrics) -------------------------------------------------------------
def _metrics_url(text: str) -> str:
    from kvmem.errors import KvmemError
    from kvmem.tiers.verdict import metrics_url

    try:
        return metrics_url(text)
    except KvmemError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tier_rows(urls: list[str]) -> list[dict]:
    """Each server's tiers, summed over its ranks (``kvmem.tiers.verdict``); a server that
    cannot be read is a row with its error."""
    from kvmem.errors import KvmemError
    from kvmem.tiers.verdict import read_figures, scrape

    rows: list[dict] = []
    for url in urls:
        try:
            figures = read_figures(scrape(url, timeout_s=5.0))
        except KvmemError as exc:
            rows.append({"server": url, "error": str(exc)})
            continue
        if not figures.tiers:
            rows.append({"server": url, "error": "no kvmem_offload_* figures"})
        rows += [{"server": url, **t.as_dict()} for t in figures.tiers.values()]
    return rows


def _tiers_table(rows: list[dict]):  # -> rich.table.Table
    from rich.table import Table

    from kvmem.units import format_bytes

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    def number(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    table = Table(title="kvmem offload tiers")
    for col in ("server", "tier", "used", "capacity", "hit rate", "hit tokens", "load GB/s",
                "prefill saved", "saved/GiB", "never loaded", "failed loads"):
        table.add_column(col, justify="left" if col in ("server", "tier") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["server"], "-", r["error"])
            continue
        table.add_row(r["server"], r["tier"], format_bytes(int(r.get("used_bytes", 0))),
                      format_bytes(int(r.get("capacity_bytes", 0))), share(r["hit_rate"]),
                      f"{r.get('hit_tokens', 0):.0f}", number(r["load_gb_per_s"], ".2f"),
                      f"{r.get('prefill_saved_seconds', 0):.2f} s",
                      number(r["prefill_saved_s_per_gib"], ".2f"), share(r["wasted_share"]),
                      f"{r.get('failed_loads', 0):.0f}")
    return table
