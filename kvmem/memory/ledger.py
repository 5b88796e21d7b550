"""The shared budget: a small file-backed table, locked with ``fcntl``, that lets engine
processes on one device share a memory limit.

Each engine has an entry (pid, held bytes, used bytes, own limit, heartbeat); the table
may also carry a ``total_limit`` for all engines together. An engine asks for bytes
before it maps pages (``EngineBudget.try_acquire``) and gives them back after it unmaps
them. Entries of processes that no longer exist are reaped on every update; an engine
whose own entry is gone (the file deleted or reset) registers again on its next update.

The file lives in ``$KVMEM_LEDGER_DIR`` (default ``/dev/shm``, else the temp directory)
as ``kvmem-ledger-<device>.json``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmem.errors import ConfigError, KvmemError

log = logging.getLogger("kvmem.memory")
LEDGER_LIMIT = 1 << 20  # bytes; an engine's entry is about 200


class UnknownEngineError(KvmemError):
    """No running engine of that name is in the ledger."""


class LedgerError(ConfigError):
    """The ledger file cannot be created or opened."""


@dataclass
class LedgerEntry:
    name: str
    pid: int
    device: str
    mapped_bytes: int  # bytes held from the budget (mapped pages plus any being mapped)
    used_bytes: int  # bytes of blocks holding live KV
    limit_bytes: int | None  # None: only the device total applies
    heartbeat: float


def ledger_dir() -> Path:
    env = os.environ.get("KVMEM_LEDGER_DIR")
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _device_key(device: str) -> str:
    """A file-name part with ASCII letters, digits and dashes only: a device name never
    leads out of the ledger directory."""
    return "".join(c if c.isascii() and c.isalnum() else "-" for c in str(device))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Ledger:
    """One device's table. Every read-modify-write holds an exclusive ``flock``."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        self.path = Path(path)
        self.device = device

    @classmethod
    def for_device(cls, device: str, directory: str | Path | None = None) -> Ledger:
        root = Path(directory) if directory else ledger_dir()
        return cls(root / f"kvmem-ledger-{_device_key(device)}.json", device)

    @classmethod
    def all(cls, directory: str | Path | None = None) -> list[Ledger]:
        root = Path(directory) if directory else ledger_dir()
        return [cls(p, p.stem.removeprefix("kvmem-ledger-"))
                for p in sorted(root.glob("kvmem-ledger-*.json"))]

    @contextmanager
    def _locked(self, write: bool) -> Iterator[dict]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise LedgerError(f"cannot open the KV memory ledger {self.path} "
                              f"({e.strerror or e}); set KVMEM_LEDGER_DIR to a writable "
                              "directory") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise LedgerError(f"the KV memory ledger {self.path} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
            raw = os.read(fd, LEDGER_LIMIT + 1)
            if len(raw) > LEDGER_LIMIT:  # far more engines than a machine runs
                raise LedgerError(f"{self.path} is larger than a KV memory ledger can be "
                                  f"({LEDGER_LIMIT} bytes); not touching it")
            try:
                table = json.loads(raw) if raw else {}
            except ValueError:  # JSON or UTF-8 errors
                table = {}  # a torn or foreign file: start a fresh table
            if not isinstance(table, dict) or not isinstance(table.get("engines", {}), dict):
                table = {}
            table.setdefault("total_limit", None)
            table.setdefault("engines", {})
            yield table
            if write:
                table["engines"] = {n: e for n, e in table["engines"].items() if _alive(e["pid"])}
                data = json.dumps(table).encode()
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, data)
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def entries(self) -> list[LedgerEntry]:
        with self._locked(write=False) as table:
            return [LedgerEntry(**e) for e in table["engines"].values() if _alive(e["pid"])]

    def total_limit(self) -> int | None:
        with self._locked(write=False) as table:
            return table["total_limit"]

    def set_total_limit(self, nbytes: int | None) -> None:
        with self._locked(write=True) as table:
            table["total_limit"] = nbytes

    def set_limit(self, name: str, nbytes: int | None) -> None:
        with self._locked(write=True) as table:
            entry = table["engines"].get(name)
            if entry is None or not _alive(entry["pid"]):
                raise UnknownEngineError(f"no running engine named {name!r} on {self.device}")
            entry["limit_bytes"] = nbytes

    def register(self, name: str, *, limit_bytes: int | None = None,
                 total_limit: int | None = None) -> EngineBudget:
        """Add this process as engine ``name``; a live engine of that name is an error."""
        with self._locked(write=True) as table:
            old = table["engines"].get(name)
            if old is not None and _alive(old["pid"]) and old["pid"] != os.getpid():
                raise ConfigError(f"an engine named {name!r} (pid {old['pid']}) already uses "
                                  f"{self.device}; pick another name")
            if total_limit is not None and table["total_limit"] is None:
                table["total_limit"] = total_limit
            table["engines"][name] = asdict(LedgerEntry(
                name, os.getpid(), self.device, 0, 0, limit_bytes, time.time()))
        return EngineBudget(self, name, limit_bytes=limit_bytes)

    def update(self, name: str, change: Callable[[dict, dict], object]) -> object:
        """Apply ``change(entry, table)`` to engine ``name`` under the lock; returns its result."""
        with self._locked(write=True) as table:
            entry = table["engines"].get(name)
            if entry is None:
                raise UnknownEngineError(f"engine {name!r} is no longer in the ledger {self.path}")
            entry["heartbeat"] = time.time()
            return change(entry, table)


class EngineBudget:
    """One engine's handle on the ledger: ask for bytes before mapping, give them back after.

    It remembers what it holds and its limit, so that when its entry is gone (the ledger
    file was deleted or reset while the engine ran) it registers again with them instead
    of failing.
    """

    def __init__(self, ledger: Ledger, name: str, *, limit_bytes: int | None = None) -> None:
        self.ledger = ledger
        self.name = name
        self.held_bytes = 0  # what this engine holds by its own count
        self.limit_bytes = limit_bytes  # its own limit, as last seen in the ledger

    def _update(self, change: Callable[[dict, dict], object]) -> object:
        """``ledger.update`` of this engine's entry, registering it again if it is gone."""
        try:
            return self.ledger.update(self.name, change)
        except UnknownEngineError:
            log.warning("KV memory ledger %s lost engine %r; registering it again "
                        "(holding %d bytes)", self.ledger.path, self.name, self.held_bytes)

        def restore(entry: dict, table: dict) -> object:
            entry["mapped_bytes"] = self.held_bytes
            return change(entry, table)

        self.ledger.register(self.name, limit_bytes=self.limit_bytes)
        return self.ledger.update(self.name, restore)

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if both this engine's limit and the device total allow it."""
        def change(entry: dict, table: dict) -> bool:
            self.limit_bytes = entry["limit_bytes"]
            held = entry["mapped_bytes"] + nbytes
            if entry["limit_bytes"] is not None and held > entry["limit_bytes"]:
                return False
            total = table["total_limit"]
            if total is not None:
                others = sum(e["mapped_bytes"] for n, e in table["engines"].items()
                             if n != self.name and _alive(e["pid"]))
                if others + held > total:
                    return False
            entry["mapped_bytes"] = held
            return True

        taken = bool(self._update(change))
        if taken:
            self.held_bytes += nbytes
        return taken

    def take(self, nbytes: int) -> None:
        """Take ``nbytes`` whatever the limits say: bytes an allocation already promised
        (the engine then trims back under its limit as blocks are freed)."""
        def change(entry: dict, table: dict) -> None:
            self.limit_bytes = entry["limit_bytes"]
            entry["mapped_bytes"] += nbytes

        self._update(change)
        self.held_bytes += nbytes

    def room(self, used_bytes: int) -> int | None:
        """Record used bytes and a heartbeat; returns how many more bytes this engine may
        take now under its own limit and the device total (negative: it is over; None: no
        limit applies)."""
        def change(entry: dict, table: dict) -> int | None:
            entry["used_bytes"] = used_bytes
            self.limit_bytes = entry["limit_bytes"]
            rooms = []
            if entry["limit_bytes"] is not None:
                rooms.append(entry["limit_bytes"] - entry["mapped_bytes"])
            if table["total_limit"] is not None:
                held = sum(e["mapped_bytes"] for e in table["engines"].values()
                           if _alive(e["pid"]))
                rooms.append(table["total_limit"] - held)
            return min(rooms) if rooms else None

        return self._update(change)  # type: ignore[return-value]

    def release(self, nbytes: int) -> None:
        def change(entry: dict, table: dict) -> None:
            entry["mapped_bytes"] = max(0, entry["mapped_bytes"] - nbytes)

        self._update(change)
        self.held_bytes = max(0, self.held_bytes - nbytes)

    def report(self, used_bytes: int) -> tuple[int, int | None]:
        """Record used bytes and a heartbeat; returns (held bytes, bytes allowed to hold)."""
        def change(entry: dict, table: dict) -> tuple[int, int | None]:
            entry["used_bytes"] = used_bytes
            self.limit_bytes = entry["limit_bytes"]
            caps = [c for c in (entry["limit_bytes"], table["total_limit"]) if c is not None]
            return entry["mapped_bytes"], (min(caps) if caps else None)

        held, allowed = self._update(change)  # type: ignore[misc]
        return held, allowed

    def close(self) -> None:
        def change(entry: dict, table: dict) -> None:
            table["engines"].pop(self.name, None)

        with suppress(UnknownEngineError):
            self.ledger.update(self.name, change)
