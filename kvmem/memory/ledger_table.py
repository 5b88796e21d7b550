"""What the ledger holds, without the file: one engine's row (``LedgerEntry``), the
table (``LedgerTable``), the errors, engine names, and the identity of an engine's process
(its pid with its start time: ``alive``). ``ledger`` reads and writes the file;
``sharing`` holds the rules over the table and ``budget`` an engine's handle on its row,
both building on this module alone, so nothing here imports them.
"""

from __future__ import annotations

import os
import reprlib
from dataclasses import dataclass, field

from kvmem.errors import ConfigError, KvmemError

MAX_NAME = 128
MAX_PID = (1 << 22)  # Linux's pid_max ceiling


class UnknownEngineError(KvmemError):
    """No running engine of that name is in the ledger."""


class LedgerError(ConfigError):
    """The ledger file cannot be used: not creatable, not a regular file of this user,
    too large, locked too long, or no room to write it."""


@dataclass
class LedgerEntry:
    """One engine's row. Sizes are bytes of the ledger's device."""

    name: str
    pid: int
    device: str
    floor_bytes: int = 0  # reserved for it: others never grow into it
    ceiling_bytes: int | None = None  # most it may hold (None: only the total applies)
    mapped_bytes: int = 0  # held: mapped pages plus budget taken for pages about to be
    live_bytes: int = 0  # of which blocks hold live KV (running requests)
    cached_bytes: int = 0  # of which cached-free blocks (prefix cache, evictable)
    request_bytes: int | None = None  # one request of max_model_len: the least ceiling
    reclaim_bytes: int = 0  # what other engines asked it to give back, not yet given
    wanted_bytes: int = 0  # what it waits for under the total
    reclaimed_bytes: int = 0  # given back to others, in all
    reclaims: int = 0  # times it gave back
    asked_at: float = 0.0  # when the ask now outstanding was made (0: none)
    answered_s: float = 0.0  # how long after the ask its last answer came
    active_at: float = 0.0  # when it last took memory (least recently active give first)
    heartbeat: float = 0.0
    start_time: int | None = None  # its process's start (clock ticks after boot): a reused
    # pid is another process; None (older entries): the pid alone is checked

    @property
    def givable_bytes(self) -> int:
        """What it could give back now: all it holds above its floor but live KV."""
        return max(0, self.mapped_bytes - max(self.floor_bytes, self.live_bytes))


@dataclass
class LedgerTable:
    total_limit: int | None = None
    engines: dict[str, LedgerEntry] = field(default_factory=dict)
    damage: list[str] = field(default_factory=list)  # what validation dropped
    total_known: bool = True  # False: the file's total was missing or damaged
    damaged: set[str] = field(default_factory=set)  # engines whose entries were damaged

    def others(self, name: str) -> list[LedgerEntry]:
        return [e for n, e in self.engines.items() if n != name]


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlevel = 2  # never recurses far: a value may be nested thousands deep


def _shown(v: object) -> str:
    """``v`` for a message: short, whatever its size or depth."""
    return _REPR.repr(v)


def _is_name(name: object) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME and name.isprintable()
            and name == name.strip())


def check_engine_name(name: str) -> str:
    """An engine name as the ledger keeps it: 1-128 printable characters, not starting
    or ending with a space."""
    if not _is_name(name):
        raise ConfigError(f"engine name {_shown(name)}: use 1-{MAX_NAME} printable "
                          "characters, not starting or ending with a space")
    return name


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (the state first), or
    None when it cannot be read."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        line = os.read(fd, 4096)  # the whole line (a few hundred bytes)
    except OSError:
        return None
    finally:
        os.close(fd)
    return line[line.rfind(b")") + 2:].split()


def _start_time(stat_fields: list[bytes]) -> int | None:
    try:
        return int(stat_fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat`` field
    22): with the pid, it names one process even after the pid is reused."""
    stat_fields = _proc_stat(pid)
    return None if stat_fields is None else _start_time(stat_fields)


def alive(pid: int, start_time: int | None = None) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet waited for by its
    parent, holds no memory and does not), and, given its ``start_time``, is still the
    process that started then (not another one that reuses the pid)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        pass
    stat_fields = _proc_stat(pid)
    if stat_fields is None:
        return True  # no /proc here: the signal said it exists
    if stat_fields[:1] == [b"Z"]:
        return False
    return start_time is None or _start_time(stat_fields) in (None, start_time)
