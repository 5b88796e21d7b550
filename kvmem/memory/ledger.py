"""The ledger: one small file-backed table per device that engine processes share, under
``fcntl.flock``, to divide the device's KV memory.

The table holds an optional ``total_limit`` for all engines on the device and one entry
per engine (``LedgerEntry``): its floor and ceiling, what it maps, what of that holds
live and cached KV, what others asked it to give back and what it gave
(``kvmem.memory.ledger_table``). This module reads and writes the file only: the rules
over the table (how much an engine may take, who gives back what, limits set by hand)
are in ``kvmem.memory.sharing``, an engine's handle on its entry and its registration in
``kvmem.memory.budget``; ``Ledger``'s ``register``, ``set_limits`` and
``set_total_limit`` hand over to them.

The file is ``kvmem-ledger-<device>.json`` in ``$KVMEM_LEDGER_DIR``; by default it is
``kvmem-<uid>-ledger-<device>.json`` in ``/dev/shm`` (else the temp directory): a folder
every user writes to, so each user has a name of their own. It is treated as hostile input:

- it is opened without following links, created ``0600`` (``0660`` in a set-group-ID
  folder, for engines of one group), and only a regular file owned by this user (or, in
  such a folder, by its group) with no other hard link is read or written;
- the read is bounded, every entry is validated field by field; a bad entry or field is
  dropped, the table is used without it, and what was wrong is kept in ``damage`` (shown
  by ``kvmem top``) until the next clean write. No content raises: nesting too deep to
  parse is damage like any other. A total that is missing or not valid is *unknown*
  (``total_known``), not "none": a write leaves it unknown, and engines put back the
  total they last knew;
- the lock wait is bounded, and a write reserves its space first, so a full file system
  leaves the old table intact (a ``LedgerError``, which engines survive).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from kvmem.memory import budget, sharing
from kvmem.memory.ledger_table import (
    MAX_PID,
    LedgerEntry,
    LedgerError,
    LedgerTable,
    UnknownEngineError,
    _is_name,
    _shown,
    alive,
    check_engine_name,
    process_start_time,
)

__all__ = ["Ledger", "LedgerEntry", "LedgerError", "LedgerTable", "UnknownEngineError",
           "alive", "check_engine_name", "ledger_dir", "parse_table", "process_start_time"]

LEDGER_LIMIT = 1 << 20  # bytes; an engine's entry is about 400
LOCK_TIMEOUT_S = 2.0  # a lock held longer belongs to a stuck process
LOCK_FIRST_PAUSE_S, LOCK_LAST_PAUSE_S = 25e-6, 1e-3  # the waits between two tries


def ledger_dir() -> Path:
    env = os.environ.get("KVMEM_LEDGER_DIR")
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _location(directory: str | Path | None) -> tuple[Path, str]:
    """The ledger folder and its files' name prefix: in the default folder, which every
    user can write to, the prefix names this user, so that another user's file of the
    same name cannot keep this user's engines from starting."""
    if directory:
        return Path(directory), "kvmem-ledger-"
    chosen = bool(os.environ.get("KVMEM_LEDGER_DIR"))
    return ledger_dir(), "kvmem-ledger-" if chosen else f"kvmem-{os.geteuid()}-ledger-"


def _device_key(device: str) -> str:
    """A file-name part with ASCII letters, digits and dashes only: a device name never
    leads out of the ledger directory."""
    return "".join(c if c.isascii() and c.isalnum() else "-" for c in str(device))


def _device_name(key: str) -> str:
    """The device a ledger file's name part stands for (``cuda-0`` -> ``cuda:0``)."""
    kind, _, index = key.partition("-")
    return f"{kind}:{index}" if kind == "cuda" and index.isdecimal() else key


# -- validation ------------------------------------------------------------------------
def _is_size(v: object, *, optional: bool = False) -> bool:
    if v is None:
        return optional
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62)


def _is_time(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_OPTIONAL = ("ceiling_bytes", "request_bytes", "start_time")
_TIMES = ("active_at", "heartbeat", "asked_at", "answered_s")
_NOT_WRITTEN = ("name", "device")  # the entry's key and the ledger's own device
_DEFAULTS = {f.name: f.default for f in fields(LedgerEntry) if f.name not in ("name", "pid",
                                                                                "device")}


def _entry(key: object, raw: object, device: str) -> tuple[LedgerEntry | None, list[str]]:
    """A validated entry (None when it cannot be one) and what was wrong in it."""
    if not _is_name(key):
        return None, [f"an entry named {_shown(key)}: not an engine name"]
    if not isinstance(raw, dict):
        return None, [f"entry {key!r}: not an object"]
    pid = raw.get("pid")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < MAX_PID):
        return None, [f"entry {key!r}: pid {_shown(pid)} is not a process id"]
    values: dict[str, object] = {}
    problems = []
    for name, default in _DEFAULTS.items():
        v = raw.get(name, default)
        ok = (_is_time(v) if name in _TIMES else
              _is_size(v, optional=name in _OPTIONAL))
        if not ok:
            problems.append(f"entry {key!r}: {name} {_shown(v)} is not valid")
            v = default
        values[name] = v
    return LedgerEntry(name=key, pid=pid, device=device, **values), problems


def parse_table(raw: bytes, device: str) -> LedgerTable:
    """The table in ``raw``, validated; what could not be used is dropped and described
    in ``damage``. An empty file is an empty table whose total is unknown. Never raises."""
    if not raw:
        return LedgerTable(total_known=False)
    try:
        doc = json.loads(raw)
    except ValueError:  # JSON or UTF-8 errors
        return LedgerTable(damage=["not a JSON document"], total_known=False)
    except RecursionError:
        return LedgerTable(damage=["nested too deep to read"], total_known=False)
    if not isinstance(doc, dict):
        return LedgerTable(damage=["not a JSON object"], total_known=False)
    table = LedgerTable()
    total = doc.get("total_limit")
    if "total_limit" not in doc:
        table.total_known = False
    elif _is_size(total, optional=True):
        table.total_limit = total
    else:
        table.total_known = False
        table.damage.append(f"total_limit {_shown(total)} is not a size")
    engines = doc.get("engines", {})
    if not isinstance(engines, dict):
        table.damage.append("engines is not an object")
        engines = {}
    for key, value in engines.items():
        entry, problems = _entry(key, value, device)
        table.damage.extend(problems)
        if problems and isinstance(key, str):
            table.damaged.add(key)
        if entry is not None:
            table.engines[key] = entry
    return table


def _living(table: LedgerTable) -> dict[str, LedgerEntry]:
    """The table's engines whose processes run."""
    return {n: e for n, e in table.engines.items() if alive(e.pid, e.start_time)}


# -- the file --------------------------------------------------------------------------
class Ledger:
    """One device's table. Every read-modify-write holds an exclusive ``flock``."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        self.path = Path(path)
        self.device = device

    @classmethod
    def for_device(cls, device: str, directory: str | Path | None = None) -> Ledger:
        root, prefix = _location(directory)
        return cls(root / f"{prefix}{_device_key(device)}.json", device)

    @classmethod
    def all(cls, directory: str | Path | None = None) -> list[Ledger]:
        root, prefix = _location(directory)
        if root.exists() and not root.is_dir():
            raise LedgerError(f"the ledger folder {root} is not a directory")
        return [cls(p, _device_name(p.stem.removeprefix(prefix)))
                for p in sorted(root.glob(f"{prefix}*.json"))]

    def _open(self) -> int:
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            shared = bool(os.stat(folder).st_mode & stat.S_ISGID)
            mode = 0o660 if shared else 0o600
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, mode)
        except OSError as e:
            why = "a link, refused" if e.errno == errno.ELOOP else (e.strerror or str(e))
            raise LedgerError(f"cannot open the KV memory ledger {self.path} ({why}); set "
                              "KVMEM_LEDGER_DIR to a writable directory") from None
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.geteuid() and not (shared and st.st_gid == os.stat(folder).st_gid):
            problem = f"belongs to user {st.st_uid}, not to this user"
        elif st.st_nlink > 1:  # a hard link would carry the table to another file
            problem = f"has {st.st_nlink} hard links"
        if problem:
            os.close(fd)
            raise LedgerError(f"the KV memory ledger {self.path} {problem}; not touching it "
                              "(set KVMEM_LEDGER_DIR to a folder of your own)")
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # past the umask; an older ledger's 0644 too
        return fd

    def _lock(self, fd: int, write: bool) -> None:
        mode = (fcntl.LOCK_EX if write else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        # another engine holds it for about 0.1-0.2 ms: look again soon, then less often
        # (a fixed 1-ms sleep cost an ask's answer up to a millisecond per write)
        pause = LOCK_FIRST_PAUSE_S
        while True:
            try:
                fcntl.flock(fd, mode)
                return
            except OSError as e:
                if not isinstance(e, BlockingIOError):
                    raise LedgerError(f"cannot lock the KV memory ledger {self.path} "
                                      f"({e.strerror or e})") from None
                if time.monotonic() > deadline:
                    raise LedgerError(f"the KV memory ledger {self.path} stayed locked for "
                                      f"{LOCK_TIMEOUT_S:g} s (a stuck process holds it)"
                                      ) from None
                time.sleep(pause)
                pause = min(2 * pause, LOCK_LAST_PAUSE_S)

    @contextmanager
    def _locked(self, write: bool) -> Iterator[LedgerTable]:
        fd = self._open()
        try:
            self._lock(fd, write)
            try:
                raw = os.read(fd, LEDGER_LIMIT + 1)
            except OSError as e:
                raise LedgerError(f"cannot read the KV memory ledger {self.path} "
                                  f"({e.strerror or e})") from None
            if len(raw) > LEDGER_LIMIT:  # far more engines than a machine runs
                raise LedgerError(f"{self.path} is larger than a KV memory ledger can be "
                                  f"({LEDGER_LIMIT} bytes); not touching it")
            table = parse_table(raw, self.device)
            yield table
            if write:
                self._write(fd, table, len(raw))
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def _write(self, fd: int, table: LedgerTable, old_size: int) -> None:
        # ``change`` reaped the dead before its change; entries hold scalars only
        live = {n: {k: v for k, v in vars(e).items() if k not in _NOT_WRITTEN}
                for n, e in table.engines.items()}
        # an unknown total stays unknown (no key) for engines to put back, never "none"
        total = ({"total_limit": table.total_limit}
                 if table.total_known or table.total_limit is not None else {})
        data = json.dumps({**total, "engines": live,
                           **({"damage": table.damage[:8]} if table.damage else {})}).encode()
        try:
            if len(data) > old_size:  # the space first: a full file system fails here
                os.posix_fallocate(fd, 0, len(data))
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        except OSError as e:
            raise LedgerError(f"cannot write the KV memory ledger {self.path} "
                              f"({e.strerror or e}); it is left as it was") from None

    # -- reads and writes --------------------------------------------------------------
    def read(self) -> LedgerTable:
        """The table as it is (dead engines left out); damage is described, not fixed."""
        with self._locked(write=False) as table:
            table.engines = _living(table)
            return table

    def entries(self) -> list[LedgerEntry]:
        return list(self.read().engines.values())

    def total_limit(self) -> int | None:
        return self.read().total_limit

    def change(self, fn: Callable[[LedgerTable], object]) -> object:
        """``fn(table)`` under the exclusive lock, then the table written back (dead
        engines reaped, damage cleared)."""
        with self._locked(write=True) as table:
            table.engines = _living(table)
            result = fn(table)
            table.damage = []
            return result

    def update(self, name: str, fn: Callable[[LedgerEntry, LedgerTable], object]) -> object:
        """``fn(entry, table)`` for engine ``name`` (its heartbeat refreshed)."""
        def change(table: LedgerTable) -> object:
            entry = table.engines.get(name)
            if entry is None:
                raise UnknownEngineError(f"engine {name!r} is no longer in the ledger "
                                         f"{self.path}")
            entry.heartbeat = time.time()
            return fn(entry, table)

        return self.change(change)

    # -- the rules' entry points ----------------------------------------------------
    def set_total_limit(self, nbytes: int | None) -> None:
        """The limit all engines on the device share (``sharing.set_total``)."""
        sharing.set_total(self, nbytes)

    def set_limits(self, name: str, *, floor_bytes: int | None = None,
                   ceiling_bytes: int | None | str = "keep") -> LedgerEntry:
        """Change engine ``name``'s floor and/or ceiling (``None`` ceiling: none; by
        default the ceiling is kept): ``sharing.set_limits``."""
        keep = isinstance(ceiling_bytes, str)
        return sharing.set_limits(self, name, floor_bytes=floor_bytes,
                                  ceiling_bytes=None if keep else ceiling_bytes,  # type: ignore[arg-type]
                                  keep_ceiling=keep)

    def register(self, name: str, *, floor_bytes: int = 0, ceiling_bytes: int | None = None,
                 request_bytes: int | None = None,
                 total_limit: int | None = None) -> budget.EngineBudget:
        """Add this process as engine ``name`` and return its handle (``budget.register``)."""
        return budget.register(self, name, floor_bytes=floor_bytes, ceiling_bytes=ceiling_bytes,
                               request_bytes=request_bytes, total_limit=total_limit)
