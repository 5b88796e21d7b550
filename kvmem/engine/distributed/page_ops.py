"""Rank 0's elastic page mapping decisions, numbered, and their replay in order elsewhere.

Decisions reach the other ranks by two roads: with each step
(``SchedulerOutput.page_ops``, drained by the scheduler) and, when the driver loads
offloaded blocks into a worker's KV cache (``kvmem.engine.distributed.remote_copy``), with
the load, since the blocks' pages must be mapped before their bytes are written and no
step may come before the load lands. Every drained batch gets the next number
(``PageOpsFeed``); a worker replays batch ``n`` only after batch ``n - 1``
(``OrderedPageOps``), whichever road each took.
"""

from __future__ import annotations

import threading
from typing import Any

from kvmem.engine.distributed.errors import ParallelError


class PageOpsFeed:
    """The driver's side: drain rank 0's decisions as numbered batches (thread-safe)."""

    def __init__(self, elastic: Any) -> None:
        self.elastic = elastic
        self._lock = threading.Lock()
        self._seq = 0

    def drain(self) -> tuple[int, list]:
        """(number, decisions since the last batch); numbers start at 1."""
        with self._lock:
            self._seq += 1
            return self._seq, self.elastic.drain_ops()


class OrderedPageOps:
    """A worker's side: replay numbered batches in order, from any thread."""

    def __init__(self, elastic: Any, timeout: float) -> None:
        self.elastic = elastic
        self.timeout = timeout
        self._applied = 0
        self._cv = threading.Condition()

    def apply(self, seq: int, ops: list) -> None:
        """Replay batch ``seq`` once batch ``seq - 1`` is replayed (waits up to ``timeout``)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._applied >= seq - 1, self.timeout):
                raise ParallelError(f"page mapping batch {seq - 1} did not arrive within "
                                    f"{self.timeout:.0f} s")
            if seq <= self._applied:
                return
            if ops:
                self.elastic.apply_ops(ops)
            self._applied = seq
            self._cv.notify_all()
