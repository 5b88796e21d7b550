"""Bounded waits: every wait between threads or processes goes through ``wait_for``.

A wait that cannot finish (a rank that never started, a mapping thread that died) must
end in a clear error naming what it waited for, never in a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvmem.errors import KvmemError


class WaitTimeout(KvmemError):
    """A bounded wait between threads or processes ran out of time."""


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str,
             cond: threading.Condition | None = None, poll: float = 0.01) -> None:
    """Return once ``predicate()`` is true; raise ``WaitTimeout`` after ``timeout`` seconds.

    With ``cond`` (whose lock the caller holds) the wait sleeps on the condition and
    ``predicate`` is evaluated under its lock; without it the predicate is polled.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        if cond is not None:
            cond.wait(min(left, 0.5))
        else:
            time.sleep(min(left, poll))
