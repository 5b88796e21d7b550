"""Elastic KV memory on this machine, for people and control planes: what each engine
holds, and the levers (floors, ceilings, device totals). ``kvmem top`` and ``kvmem
limit`` are built on it; so can anything that steers several engines::

    from kvmem.memory import control

    for device in control.devices():              # every ledger in $KVMEM_LEDGER_DIR
        for e in device.engines:
            print(device.device, e.name, e.mapped_bytes, e.live_bytes, e.cached_bytes)
    control.set_limits("llama", floor_bytes=2 << 30, ceiling_bytes=8 << 30)
    control.set_total("cuda:0", 60 << 30)

``document(devices())`` is ``kvmem top --json``'s document; its fields are kept stable
(``version`` says which). Torch-free.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmem.memory import wake
from kvmem.memory.ledger import Ledger, LedgerEntry, LedgerError, UnknownEngineError
from kvmem.memory.sharing import allowed, reserved

DOCUMENT_VERSION = 1


@dataclass(frozen=True)
class EngineView:
    name: str
    pid: int
    floor_bytes: int
    ceiling_bytes: int | None
    allowed_bytes: int | None  # the most it may hold now (ceiling and device total)
    mapped_bytes: int
    live_bytes: int  # running requests' KV
    cached_bytes: int  # prefix cache, evictable
    reclaim_bytes: int  # asked of it by others, not yet given
    wanted_bytes: int  # what it waits for under the total
    reclaimed_bytes: int  # given back to others, in all
    reclaims: int
    idle_s: float  # since it last took memory
    heartbeat_age_s: float
    request_bytes: int | None = None  # one request of its max_model_len: the least ceiling

    @classmethod
    def of(cls, entry: LedgerEntry, table, now: float) -> EngineView:
        return cls(entry.name, entry.pid, entry.floor_bytes, entry.ceiling_bytes,
                   allowed(table, entry), entry.mapped_bytes, entry.live_bytes,
                   entry.cached_bytes, entry.reclaim_bytes, entry.wanted_bytes,
                   entry.reclaimed_bytes, entry.reclaims,
                   round(max(0.0, now - entry.active_at), 1),
                   round(max(0.0, now - entry.heartbeat), 1), entry.request_bytes)


@dataclass(frozen=True)
class DeviceView:
    device: str
    ledger: str  # its file
    total_bytes: int | None
    held_bytes: int  # every engine's mapped bytes
    reserved_bytes: int  # what the total counts: each engine's mapped or floor, if more
    engines: list[EngineView]
    damage: list[str]  # what was wrong in the file (dropped until the next write)
    error: str | None = None  # the file could not be read at all


def devices(ledger_dir: str | Path | None = None) -> list[DeviceView]:
    """Every device with a ledger, its engines in name order."""
    views = []
    now = time.time()
    for ledger in Ledger.all(ledger_dir):
        try:
            table = ledger.read()
        except LedgerError as e:
            views.append(DeviceView(ledger.device, str(ledger.path), None, 0, 0, [], [], str(e)))
            continue
        entries = sorted(table.engines.values(), key=lambda e: e.name)
        views.append(DeviceView(
            ledger.device, str(ledger.path), table.total_limit,
            sum(e.mapped_bytes for e in entries), sum(reserved(e) for e in entries),
            [EngineView.of(e, table, now) for e in entries], table.damage))
    return views


def document(views: list[DeviceView]) -> dict:
    return {"version": DOCUMENT_VERSION, "devices": [asdict(v) for v in views]}


def set_limits(name: str, *, floor_bytes: int | None = None,
               ceiling_bytes: int | None | str = "keep", device: str | None = None,
               ledger_dir: str | Path | None = None) -> list[str]:
    """Change engine ``name``'s floor and/or ceiling (``ceiling_bytes=None``: none) on
    ``device`` (default: wherever it runs); returns the devices changed. The engine is
    woken to apply it at once."""
    ledgers = Ledger.all(ledger_dir)
    if device is not None:
        path = Ledger.for_device(device, ledger_dir).path
        ledgers = [ledger for ledger in ledgers if ledger.path == path]
    changed = []
    for ledger in ledgers:
        try:
            entry = ledger.set_limits(name, floor_bytes=floor_bytes, ceiling_bytes=ceiling_bytes)
        except UnknownEngineError:
            continue
        wake.wake_engines(ledger.path, [entry])  # to apply it now, not at a heartbeat
        changed.append(ledger.device)
    if not changed:
        raise UnknownEngineError(f"no running engine named {name!r} (see kvmem top)")
    return changed


def set_total(device: str, nbytes: int | None, ledger_dir: str | Path | None = None) -> None:
    """The limit all engines on ``device`` share (None: no total); refused in one line
    when it cannot hold their floors."""
    ledger = Ledger.for_device(device, ledger_dir)
    ledger.set_total_limit(nbytes)
    with contextlib.suppress(LedgerError):
        wake.wake_engines(ledger.path, ledger.entries())
