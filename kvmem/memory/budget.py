"""``EngineBudget``: one engine's handle on its ledger entry.

An engine asks for bytes before it maps pages (``try_acquire``) and gives them back after
it unmaps them (``release``); its heartbeat (``report``) records what of its memory holds
live and cached KV and reads back what it may hold and what other engines asked it to
give back (``kvmem.memory.sharing`` decides both). It is the authority on what it holds:
every write puts its own count in its entry, so an entry edited, deleted or reset while
it runs is put right (a lost or damaged entry is registered again, with a warning), and
so is the device total, which it remembers as it was started or last set: a total lost
to damage is put back. A read (``peek``, an idle engine's poll) that finds either wrong
writes at once, so an idle engine is never left out of the total.

Nothing in the ledger file can stop an engine: when the file cannot be used (replaced by
a directory or a link, another user's, locked by a stuck process, no room on its file
system), the engine logs it once and goes on with its own accounting, within what it was
last allowed to hold, and goes back to the ledger, with a line in the log, once the file
is usable again. Thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvmem.errors import ConfigError
from kvmem.memory import wake
from kvmem.memory.ledger_table import (
    LedgerEntry,
    LedgerError,
    LedgerTable,
    alive,
    check_engine_name,
    process_start_time,
)
from kvmem.memory.sharing import (
    allowed,
    ask_reclaim,
    attainable,
    check_limits,
    check_total,
    room,
)
from kvmem.memory.wait import wait_for

if TYPE_CHECKING:
    from kvmem.memory.ledger import Ledger

log = logging.getLogger("kvmem.memory")
T = TypeVar("T")


class Budget(Protocol):
    """What a page table takes the bytes of its pages from (``kvmem.memory.credit``): an
    engine's ledger entry (``EngineBudget``), or vLLM's view of it within a step
    (``integrations.vllm.elastic.pool.LedgerView``). ``allowed_bytes``: the cap the page
    table keeps under by itself (None: none); ``attainable_bytes``: the most it could
    hold once other engines gave back what they only cache (None: no limit)."""

    @property
    def allowed_bytes(self) -> int | None: ...

    @property
    def attainable_bytes(self) -> int | None: ...

    def try_acquire(self, nbytes: int) -> bool: ...

    def release(self, nbytes: int) -> None: ...


@dataclass(frozen=True)
class BudgetState:
    """What a heartbeat reads back."""

    held_bytes: int
    allowed_bytes: int | None  # the most it may hold now (None: no limit)
    reclaim_bytes: int  # what other engines asked it to give back
    attainable_bytes: int | None = None  # the most it could hold if others gave back
    read_at: float = 0.0  # time.monotonic() as the read began (``EngineBudget.answered_at``)


class EngineBudget:
    def __init__(self, ledger: Ledger, name: str, *, floor_bytes: int = 0,
                 ceiling_bytes: int | None = None, request_bytes: int | None = None) -> None:
        self.ledger = ledger
        self.name = name
        self.floor_bytes = floor_bytes
        self.ceiling_bytes = ceiling_bytes  # as last seen in the ledger
        self.request_bytes = request_bytes  # one request of max_model_len
        self.held_bytes = 0  # by its own count
        self.allowed_bytes: int | None = ceiling_bytes  # as last read back
        self.attainable_bytes: int | None = ceiling_bytes
        self.reclaimed_bytes = 0  # given back to other engines, in all
        self.reclaims = 0
        self.total_limit: int | None = None  # the device total, as last known
        self.problem: str | None = None  # why the ledger is not used now, if it is not
        self.answered_s: float | None = None  # its last answer, after the ask
        self.answered_at = 0.0  # time.monotonic() once its last answer was written
        self._releases_unwritten = False  # ``answering``: releases wait for the answer
        self._lock = threading.RLock()
        self._answered = threading.Condition(self._lock)  # ``answering`` ended
        self._start_time = process_start_time(os.getpid())
        self._listener: wake.WakeListener | None = None

    # -- the entry ---------------------------------------------------------------------
    def _entry(self) -> LedgerEntry:
        now = time.time()
        return LedgerEntry(self.name, os.getpid(), self.ledger.device,
                           floor_bytes=self.floor_bytes, ceiling_bytes=self.ceiling_bytes,
                           mapped_bytes=self.held_bytes, request_bytes=self.request_bytes,
                           reclaimed_bytes=self.reclaimed_bytes, reclaims=self.reclaims,
                           active_at=now, heartbeat=now, start_time=self._start_time)

    def _mine(self, table: LedgerTable) -> LedgerEntry | None:
        """Its entry, if the table holds it intact."""
        entry = table.engines.get(self.name)
        if entry is None or entry.pid != os.getpid() or self.name in table.damaged:
            return None
        return entry

    def _keep_total(self, table: LedgerTable) -> None:
        """Learn the device total from the table, or put back the one it knew when the
        table's was lost to damage."""
        if table.total_known:
            self.total_limit = table.total_limit
        elif self.total_limit is not None:
            log.warning("KV memory ledger %s lost the device total; putting back %d bytes",
                        self.ledger.path, self.total_limit)
            table.total_limit, table.total_known = self.total_limit, True

    def register(self, total_limit: int | None = None) -> None:
        """Add the entry; refused in one line when a live engine of another process has
        the name or the floors would not fit the total (start-up errors, not degraded)."""
        def change(table: LedgerTable) -> None:
            old = table.engines.get(self.name)
            if old is not None and alive(old.pid, old.start_time) and old.pid != os.getpid():
                raise ConfigError(f"an engine named {self.name!r} (pid {old.pid}) already "
                                  f"uses {self.ledger.device}; pick another name")
            if total_limit is not None and table.total_limit is None:
                check_total(table, total_limit)
                table.total_limit, table.total_known = total_limit, True
            check_limits(table, self.name, self.floor_bytes, self.ceiling_bytes,
                         self.request_bytes)
            table.engines[self.name] = self._entry()
            self.total_limit = table.total_limit

        with self._lock:
            self.ledger.change(change)

    def _update(self, fn: Callable[[LedgerEntry, LedgerTable], T],
                fallback: Callable[[], T]) -> T:
        """``fn`` on this engine's entry, with its own held count written in; the entry
        registered again if it is gone; ``fallback()`` when the ledger cannot be used."""
        def change(table: LedgerTable) -> T:
            entry = table.engines.get(self.name)
            if entry is not None and entry.pid != os.getpid() and alive(entry.pid,
                                                                        entry.start_time):
                raise LedgerError(f"engine name {self.name!r} in the KV memory ledger "
                                  f"{self.ledger.path} was taken by pid {entry.pid}")
            self._keep_total(table)
            if self._mine(table) is None:
                log.warning("KV memory ledger %s lost engine %r or damaged its entry; "
                            "registering it again (holding %d bytes)", self.ledger.path,
                            self.name, self.held_bytes)
                entry = table.engines[self.name] = self._entry()
            entry.heartbeat = time.time()
            entry.mapped_bytes = self.held_bytes
            self.floor_bytes, self.ceiling_bytes = entry.floor_bytes, entry.ceiling_bytes
            result = fn(entry, table)
            # what it may hold, as of this write: a take raises it by what it took
            self.allowed_bytes = allowed(table, entry)
            self.attainable_bytes = attainable(table, entry)
            return result

        try:
            result = self.ledger.change(change)
        except LedgerError as e:
            if str(e) != self.problem:
                limit = ("no limit" if self.allowed_bytes is None
                         else f"at most {self.allowed_bytes} bytes")
                log.warning("%s; engine %r goes on with its own accounting (%s)", e,
                            self.name, limit)
                self.problem = str(e)
            return fallback()
        if self.problem is not None:
            log.warning("KV memory ledger %s is usable again; engine %r is back in it",
                        self.ledger.path, self.name)
            self.problem = None
        return result  # type: ignore[return-value]

    # -- taking and giving back --------------------------------------------------------
    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if this engine's ceiling and the device total allow it; if the
        total refuses, other engines are asked to give back what they only cache."""
        def change(entry: LedgerEntry, table: LedgerTable) -> bool:
            r = room(table, entry)
            if r is not None and nbytes > r:
                asked.extend(ask_reclaim(table, entry, nbytes))
                return False
            entry.mapped_bytes += nbytes
            entry.active_at = time.time()
            entry.wanted_bytes = 0
            return True

        def own() -> bool:
            return self.allowed_bytes is None or self.held_bytes + nbytes <= self.allowed_bytes

        asked: list[LedgerEntry] = []
        with self._lock:
            taken = self._update(change, own)
            if taken:
                self.held_bytes += nbytes
        self._wake(asked)
        return taken

    def want(self, nbytes: int) -> bool:
        """It waits for ``nbytes`` more: if the device total keeps them from it, ask other
        engines for them now (asks already outstanding count), without taking anything.
        Returns whether they come: other engines are asked for some (it comes at their
        next look at the ledger), or the room is there already (given back since the
        engine last read the ledger: its next read finds it)."""
        def change(entry: LedgerEntry, table: LedgerTable) -> bool:
            r = room(table, entry)
            if r is None or nbytes <= r:
                entry.wanted_bytes = 0
                return r is not None
            asked.extend(ask_reclaim(table, entry, nbytes))
            return any(e.reclaim_bytes for e in table.others(entry.name))

        asked: list[LedgerEntry] = []
        with self._lock:
            coming = self._update(change, lambda: False)
        self._wake(asked)
        return coming

    def take(self, nbytes: int) -> None:
        """Take ``nbytes`` whatever the limits say: bytes an allocation already promised
        (the engine then gives back as blocks are freed)."""
        def change(entry: LedgerEntry, table: LedgerTable) -> None:
            entry.mapped_bytes += nbytes
            entry.active_at = time.time()

        with self._lock:
            self._update(change, lambda: None)
            self.held_bytes += nbytes

    def release(self, nbytes: int) -> None:
        def change(entry: LedgerEntry, table: LedgerTable) -> None:
            entry.mapped_bytes = max(0, entry.mapped_bytes - nbytes)

        with self._lock:
            if not self._releases_unwritten:
                self._update(change, lambda: None)
            self.held_bytes = max(0, self.held_bytes - nbytes)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Give back inside, then call ``gave_back``: the releases are written with the
        answer, in one ledger write. Until then the ledger counts the bytes as still held,
        which keeps every other engine within the total."""
        with self._lock:
            self._releases_unwritten = True
        try:
            yield
        finally:
            with self._lock:
                self._releases_unwritten = False
                self._answered.notify_all()

    def flush(self, timeout: float = 10.0) -> None:
        """Have the ledger count what the engine holds now. Releases made while another
        thread answers an ask are written with that answer (``answering``): this waits for
        it, then writes the held count if the ledger's differs (``peek``)."""
        with self._lock:
            wait_for(lambda: not self._releases_unwritten, cond=self._answered,
                     timeout=timeout, what=f"engine {self.name!r}'s answer to be written")
            self.peek()

    # -- heartbeat ---------------------------------------------------------------------
    def report(self, live_bytes: int, cached_bytes: int = 0) -> BudgetState:
        """Record what of its memory holds live and cached KV (and a heartbeat); read back
        what it may hold and what it is asked to give back."""
        def change(entry: LedgerEntry, table: LedgerTable) -> int:
            entry.live_bytes, entry.cached_bytes = live_bytes, cached_bytes
            return entry.reclaim_bytes

        with self._lock:
            start = time.monotonic()
            return self._state(self._update(change, lambda: 0), start)

    def _state(self, reclaim_bytes: int, read_at: float) -> BudgetState:
        return BudgetState(self.held_bytes, self.allowed_bytes, reclaim_bytes,
                           self.attainable_bytes, read_at)

    def room(self, live_bytes: int, cached_bytes: int = 0) -> int | None:
        """``report``, as the bytes it may still take (negative: over; None: no limit)."""
        state = self.report(live_bytes, cached_bytes)
        return None if state.allowed_bytes is None else state.allowed_bytes - state.held_bytes

    def peek(self) -> BudgetState:
        """What it may hold and is asked to give back, read without writing (cheap enough
        to poll often) unless its entry or the device total needs putting right; its
        last known state when the ledger cannot be read."""
        with self._lock:
            start = time.monotonic()
            try:
                table = self.ledger.read()
            except LedgerError:
                return self._state(0, start)
            entry = self._mine(table)
            if (entry is None or entry.mapped_bytes != self.held_bytes
                    or not table.total_known and self.total_limit is not None):
                return self._state(self._update(lambda e, t: e.reclaim_bytes, lambda: 0),
                                   start)
            self._keep_total(table)
            return BudgetState(self.held_bytes, allowed(table, entry), entry.reclaim_bytes,
                               attainable(table, entry), start)

    def gave_back(self, nbytes: int, answered: BudgetState,
                  usage: tuple[int, int] | None = None) -> None:
        """It answered the ask it read in ``answered``: ``nbytes`` went back (already
        ``release``d). Whatever it could not give is asked again by the engine still
        short; what was asked after that read stays asked (asked since the read began).
        How long after the ask it answered is kept in its entry (``answered_s``) and here;
        when the answer was written, in ``answered_at`` (a state read before then may hold
        the ask it answered). ``usage``: its live and cached bytes now, as ``report``
        records them (what other engines may ask of it next)."""
        def change(entry: LedgerEntry, table: LedgerTable) -> None:
            now = time.time()
            if usage is not None:
                entry.live_bytes, entry.cached_bytes = usage
            if entry.reclaim_bytes and entry.asked_at:
                entry.answered_s = self.answered_s = max(0.0, now - entry.asked_at)
            later = max(0, entry.reclaim_bytes - answered.reclaim_bytes)
            read_at = now - (time.monotonic() - answered.read_at)  # as wall-clock time
            entry.reclaim_bytes, entry.asked_at = later, read_at if later else 0.0
            entry.reclaimed_bytes, entry.reclaims = self.reclaimed_bytes, self.reclaims

        with self._lock:
            if nbytes > 0:
                self.reclaimed_bytes += nbytes
                self.reclaims += 1
            self._update(change, lambda: None)
            self.answered_at = time.monotonic()

    # -- wake-ups ----------------------------------------------------------------------
    def address(self) -> str:
        """Its wake-up socket's name (``kvmem.memory.wake``)."""
        return wake.address(self.ledger.path, self.name, os.getpid(), self._start_time)

    def listen(self, on_wake: Callable[[], None]) -> bool:
        """Call ``on_wake()`` (on a thread of its own) whenever another engine asks this
        one for memory, or a limit of it changes; whether it can (else: poll)."""
        with self._lock:
            if self._listener is None:
                self._listener = wake.WakeListener.start(self.address(), on_wake)
            return self._listener is not None

    def _wake(self, entries: list[LedgerEntry]) -> None:
        if entries:
            wake.wake_engines(self.ledger.path, entries)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

        def change(table: LedgerTable) -> None:
            entry = table.engines.get(self.name)
            if entry is not None and entry.pid == os.getpid():
                del table.engines[self.name]

        with self._lock, contextlib.suppress(LedgerError):  # nothing to leave
            self.ledger.change(change)


def register(ledger: Ledger, name: str, *, floor_bytes: int = 0,
             ceiling_bytes: int | None = None, request_bytes: int | None = None,
             total_limit: int | None = None) -> EngineBudget:
    """Add this process to ``ledger`` as engine ``name`` (a live engine of that name is an
    error; so are floors the total cannot hold) and return its ``EngineBudget``."""
    handle = EngineBudget(ledger, check_engine_name(name), floor_bytes=floor_bytes,
                          ceiling_bytes=ceiling_bytes, request_bytes=request_bytes)
    handle.register(total_limit=total_limit)
    return handle


class MemoryWait:
    """Whether an engine short of memory keeps waiting for what other engines give back,
    rather than preempting its own requests: while it is asked for (``coming``) and some
    arrives (``held`` grows) at least every ``wait_s`` seconds."""

    def __init__(self, wait_s: float = 5.0) -> None:
        self.wait_s = wait_s
        self._since: float | None = None  # when this wait began, or memory last arrived
        self._held = 0
        self._last = float("-inf")  # the previous call

    def __call__(self, coming: bool, held: int) -> bool:
        now = time.monotonic()
        last, self._last = self._last, now
        if not coming:
            self._since = None
            return False
        # A wait is asked about at every step it lasts: a gap longer than the wait means
        # the last one ended (its requests ran or finished) and this is a new one.
        if self._since is None or held > self._held or now - last > self.wait_s:
            self._since = now
        self._held = held
        return now - self._since < self.wait_s
