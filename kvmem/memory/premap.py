"""The pre-mapping thread: keeps a few mapped free pages ready and gives back the rest.

It runs ``PageTable.maintain_once`` until there is nothing to do, then sleeps until a
block is freed or allocated, or a short interval passes: every ``interval`` (0.25 s) it
sends a heartbeat, which also picks up a limit changed with ``kvmem limit`` and answers
other engines' asks to give memory back. ``wake`` makes the heartbeat due at once (an
engine that asks for memory wakes it: ``kvmem.memory.wake``); where no wake-up can
reach it, it looks every ``watch_interval`` (0.05 s), read-only, whether such an ask or
a lowered limit waits, to answer it then. It starts only after the null block's page is
mapped, and stopping it is bounded. An error (e.g. an unreadable ledger) is logged and
kept for ``settle``; the thread retries after its interval instead of stopping, so
pre-mapping and heartbeats resume once the cause is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvmem.memory.page_table import PageTable
from kvmem.memory.wait import WaitTimeout, wait_for

log = logging.getLogger("kvmem.memory")
REPEAT_LOG_S = 30.0


class PremapThread:
    def __init__(self, table: PageTable, *, heartbeat: Callable[[], None] | None = None,
                 interval: float = 0.25, watch: Callable[[], bool] | None = None,
                 watch_interval: float = 0.05) -> None:
        self.table = table
        self.heartbeat = heartbeat
        self.interval = interval
        self.watch = watch  # True: the heartbeat is due now
        self.watch_interval = watch_interval
        self.error: BaseException | None = None  # the latest error, raised by settle()
        self._logged_at = 0.0
        self._woken = False  # another engine asked: the heartbeat is due now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmem-premap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        last_beat = last_watch = 0.0
        wait = self.interval if self.watch is None else min(self.interval, self.watch_interval)
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                with self.table.cond:
                    due, self._woken = now - last_beat >= self.interval or self._woken, False
                if not due and self.watch is not None and now - last_watch >= self.watch_interval:
                    last_watch = now
                    due = self.watch()
                if self.heartbeat is not None and due:
                    last_beat = time.monotonic()
                    self.heartbeat()
                if self.table.maintain_once():
                    continue
            except Exception as e:  # logged, kept for settle(); pre-mapping goes on
                self._record(e)
            with self.table.cond:
                if not self._woken:
                    self.table.cond.wait(wait)

    def wake(self) -> None:
        """Send the heartbeat now (another engine asked for memory, or a limit changed)."""
        with self.table.cond:
            self._woken = True
            self.table.cond.notify_all()

    def _record(self, error: Exception) -> None:
        """Log an error of the thread (a repeat of the last one at most every 30 s)."""
        now = time.monotonic()
        if repr(error) != repr(self.error) or now - self._logged_at >= REPEAT_LOG_S:
            log.error("KV pre-mapping: %s: %s (retrying every %g s)", type(error).__name__,
                      error, self.interval, exc_info=error)
            self._logged_at = now
        self.error = error

    def settle(self, timeout: float = 10.0) -> None:
        """Finish all pending pre-mapping and trimming now (tests and benchmarks).

        The calling thread does the remaining work itself, then waits for the
        background thread's page in flight, if any.
        """
        deadline = time.monotonic() + timeout
        table = self.table
        while True:
            while table.maintain_once():
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"timed out after {timeout:g} s waiting for KV pages "
                                      "to settle")
            with table.cond:
                wait_for(lambda: not table.pages_in_flight(), cond=table.cond,
                         timeout=max(0.0, deadline - time.monotonic()),
                         what="the pre-mapping thread to finish its page in flight")
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            if not table.maintain_once():
                return

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self.table.cond:
            self.table.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise WaitTimeout(f"timed out after {timeout:g} s waiting for the pre-mapping "
                                  "thread to stop")
