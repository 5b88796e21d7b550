"""``kvmem top``: engines sharing elastic KV memory on this machine, from the ledgers:
per engine its floor, ceiling, what it may hold now, mapped, live and cached bytes, what it
gave back to others and what it waits for (``kvmem.memory.control``); ``--json`` prints
``control.document``, a stable, versioned form. With ``--metrics URL``, also the offload
tiers of those servers (their ``/metrics``)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

MAX_WATCH_S = 86400.0  # a day
STALE_S = 5.0  # a stepping engine's heartbeats come every 0.25 s, or with every step
MAX_ENGINES = 64  # rows of the table; --json lists all
MAX_NOTES = 24  # lines under it: totals, damaged ledgers, engines stopped or stuck
MAX_AGE_S = 366 * 86400.0  # an age beyond is no age of an engine (when boot time is unknown)
CLOCK_SLACK_S = 2.0  # process start times are known to a clock tick, boot time to 1 s


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


def _views(ledger_dir: str | None) -> list:
    from kvmem.memory import control

    return control.devices(ledger_dir)


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch); None when unknown."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _boot_time() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.boot_time()


@dataclass
class _Clock:
    """What an age read from the ledger may be: no older than the engine's process (a
    process started after its entry's last heartbeat is not that engine: its pid was
    reused), or than the machine's boot."""

    now: float
    boot: float | None

    def process_age(self, pid: int) -> float | None:
        started = _started_at(pid)
        return None if started is None else self.now - started

    def plausible(self, age_s: float, process_age_s: float | None) -> bool:
        oldest = process_age_s if process_age_s is not None else \
            (self.now - self.boot if self.boot is not None else MAX_AGE_S)
        return age_s <= oldest + CLOCK_SLACK_S


def _age(seconds: float, plausible: bool) -> str:
    if not plausible:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _trouble(e, process_age: float | None, clock: _Clock) -> str | None:
    """What is wrong with engine ``e`` (a ``control.EngineView``), if anything. No
    heartbeat alone is not: an idle vLLM engine runs no step, so it writes none; without
    running requests it is idle, not stuck."""
    if process_age is not None and e.heartbeat_age_s > process_age + CLOCK_SLACK_S:
        return (f"stopped: pid {e.pid} is another process now (one started after the "
                "engine's last heartbeat)")
    if e.heartbeat_age_s > STALE_S and e.live_bytes:
        since = f" for {_age(e.heartbeat_age_s, True)}" \
            if clock.plausible(e.heartbeat_age_s, process_age) else ""
        return f"holds running requests' KV, but no heartbeat{since} (stuck?)"
    return None


def _render(views: list):  # -> a rich renderable
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    clock = _Clock(time.time(), _boot_time())

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
    hidden = 0  # engines past MAX_ENGINES rows
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
        listed = v.engines[:MAX_ENGINES - table.row_count]
        hidden += len(v.engines) - len(listed)
        for e in listed:
            given = f"{size(e.reclaimed_bytes)}/{e.reclaims}" if e.reclaims else "-"
            process_age = clock.process_age(e.pid)
            idle = _age(e.idle_s, clock.plausible(e.idle_s, process_age))
            # names are shown as text, never as rich markup
            table.add_row(Text(e.name), str(e.pid), Text(v.device), size(e.floor_bytes),
                          size(e.ceiling_bytes), size(e.mapped_bytes), size(e.live_bytes),
                          size(e.cached_bytes), given,
                          size(e.wanted_bytes) if e.wanted_bytes else "-", idle)
            trouble = _trouble(e, process_age, clock)
            if trouble is not None:
                notes.append(Text(f"{e.name}: {trouble}", style="yellow"))
    if len(notes) > MAX_NOTES:
        notes[MAX_NOTES:] = [Text(f"and {len(notes) - MAX_NOTES:,} more notes like these")]
    if hidden:
        notes.append(Text(f"and {hidden:,} more engines (kvmem top --json lists them all)"))
    if not table.row_count:
        return Group(Text("no engines use elastic KV memory"), *notes)
    return Group(table, *notes)


def run(args: argparse.Namespace) -> int:
    from kvmem.cli.output import PIPE_CLOSED, guarded_stdout

    with guarded_stdout() as written:
        status = _show(args)
    return PIPE_CLOSED if written.closed_early else status


def _show(args: argparse.Namespace) -> int:
    from kvmem.errors import KvmemError
    from kvmem.memory import control

    if len(set(args.metrics)) > MAX_SERVERS:
        raise KvmemError(f"--metrics: at most {MAX_SERVERS} servers, got "
                         f"{len(set(args.metrics))}")

    def screen():  # -> a rich renderable; each server's /metrics read once
        from rich.console import Group

        elastic = _render(_views(args.ledger_dir))
        return Group(elastic, _tiers_table(_tier_rows(args.metrics))) if args.metrics \
            else elastic

    if args.json:
        doc = control.document(_views(args.ledger_dir))
        if args.metrics:
            doc["tiers"] = _tier_rows(args.metrics)
        print(json.dumps(doc, indent=1))
        return 0
    from rich.console import Console

    # never narrower than the table: a cut name could not be given to `kvmem limit`
    console = Console()
    wide = console.options.update(max_width=400)
    now = screen()
    console = Console(width=max(console.width, console.measure(now, options=wide).maximum))
    console.on_broken_pipe = _closed  # rich's own handling would exit 1
    if args.watch is None:
        console.print(now)
        return 0
    if not console.is_terminal:  # a pipe or a file: one screen after another
        while True:
            console.print(now)
            console.file.flush()
            time.sleep(args.watch)
            now = screen()
    from rich.live import Live

    # drawn from this thread only, when the screen changes: a closed pipe ends it here
    with Live(now, console=console, auto_refresh=False) as live:
        while True:
            time.sleep(args.watch)
            live.update(screen(), refresh=True)


def _closed() -> None:
    raise BrokenPipeError


# -- offload tiers (--metrics) -------------------------------------------------------------
SCRAPE_TIMEOUT_S = 5.0  # each server's whole answer
MAX_SERVERS = 32  # --metrics given more often is refused


def _metrics_url(text: str) -> str:
    from kvmem.errors import KvmemError
    from kvmem.tiers.scrape import metrics_url

    try:
        return metrics_url(text)
    except KvmemError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tier_rows(urls: list[str]) -> list[dict]:
    """Each server's tiers, summed over its ranks (``kvmem.tiers.verdict``); a server that
    cannot be read, or whose page makes no sense, is a row with its error. The servers
    are read at once: one that does not answer holds the screen for one deadline, not one
    each."""
    from concurrent.futures import ThreadPoolExecutor

    urls = list(dict.fromkeys(urls))
    with ThreadPoolExecutor(max_workers=max(1, min(len(urls), MAX_SERVERS))) as pool:
        return [row for rows in pool.map(_server_rows, urls) for row in rows]


def _server_rows(url: str) -> list[dict]:
    from kvmem.errors import KvmemError
    from kvmem.tiers.scrape import scrape
    from kvmem.tiers.verdict import read_figures

    try:
        figures = read_figures(scrape(url, timeout_s=SCRAPE_TIMEOUT_S))
    except KvmemError as exc:
        return [{"server": url, "error": str(exc)}]
    if not figures.tiers:
        return [{"server": url, "error": "no kvmem_offload_* figures"}]
    return [{"server": url, **t.as_dict()} for t in figures.tiers.values()]


def _tiers_table(rows: list[dict]):  # -> rich.table.Table
    from rich.table import Table
    from rich.text import Text

    from kvmem.tiers.scrape import shown
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
        # what a server sent is shown as text, never as rich markup
        server = Text(shown(r["server"], 60))
        if "error" in r:
            table.add_row(server, "-", Text(r["error"], style="red"))
            continue
        table.add_row(server, Text(shown(r["tier"], 24)),
                      format_bytes(int(r.get("used_bytes", 0))),
                      format_bytes(int(r.get("capacity_bytes", 0))), share(r["hit_rate"]),
                      f"{r.get('hit_tokens', 0):.0f}", number(r["load_gb_per_s"], ".2f"),
                      f"{r.get('prefill_saved_seconds', 0):.2f} s",
                      number(r["prefill_saved_s_per_gib"], ".2f"), share(r["wasted_share"]),
                      f"{r.get('failed_loads', 0):.0f}")
    return table
