"""Giving memory back while vLLM is idle: waking vLLM's engine core loop when another
engine asks this one for memory.

vLLM's engine core takes no step while it has no request: it waits on its input queue,
and the scheduler-side pool (``pool.ElasticPool``) only reads the ledger at a step. So
``LedgerWatch`` listens for the wake-up an engine short of memory sends the engines it
asks (``kvmem.memory.wake``) and puts vLLM's own no-op ``WAKEUP`` message on the core's
input queue at once. The loop then asks the connectors whether they have work
(``has_pending_push_work``): the pool gives back what it can, on the loop's own thread.
A busy engine answers at its next step end; the wake-up is harmless then. It also reads
the engine's entry (a shared-lock read, no write) every 250 ms, for a ceiling lowered
in the ledger, and every 50 ms where no wake-up can reach it.

The wake-up needs the core's input queue: ``with_core_wakeup`` wraps
``EngineCoreProc.run_busy_loop`` (in the engine core process only) to register it. With
vLLM's in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) there is no loop to
wake, and an idle engine gives back at its next step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import wraps
from typing import Any

from kvmem.memory.budget import EngineBudget

log = logging.getLogger("vllm.kvmem.elastic")
WATCH_INTERVAL_S = 0.05  # where no wake-up reaches the engine
LIMIT_INTERVAL_S = 0.25  # where one does: only for limits changed in the ledger
_MARK = "_kvmem_core_wakeup"
_wakers: list[Callable[[], None]] = []  # one per engine core loop in this process


def wake_engine_core() -> bool:
    """Wake the engine core loop of this process, if it runs one; whether it does."""
    for wake in list(_wakers):
        wake()
    return bool(_wakers)


def with_core_wakeup(run_busy_loop: Any) -> Any:
    """``EngineCoreProc.run_busy_loop`` that first registers a wake-up on its input queue."""
    @wraps(run_busy_loop)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.engine import EngineCoreRequestType

        queue = self.input_queue
        _wakers.append(lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None)))
        return run_busy_loop(self, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def install_core_wakeup(core_module: Any) -> None:
    """Wrap the engine core loop of ``vllm.v1.engine.core`` (idempotent)."""
    proc = core_module.EngineCoreProc
    if not getattr(proc.run_busy_loop, _MARK, False):
        proc.run_busy_loop = with_core_wakeup(proc.run_busy_loop)


class LedgerWatch:
    """Wakes the engine core when its ledger entry asks for memory back (see above)."""

    def __init__(self, budget: EngineBudget, held: Callable[[], int],
                 wake: Callable[[], bool] = wake_engine_core,
                 interval: float = WATCH_INTERVAL_S) -> None:
        self.budget = budget
        self.held = held  # the bytes the engine holds now
        self.wake = wake
        self.wakes = 0
        self.interval = LIMIT_INTERVAL_S if budget.listen(self._woken) else interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmem-ledger-watch",
                                        daemon=True)
        self._thread.start()

    def due(self) -> bool:
        """Whether the engine is asked to give back, or holds more than it may."""
        state = self.budget.peek()
        return state.reclaim_bytes > 0 or (state.allowed_bytes is not None
                                           and self.held() > state.allowed_bytes)

    def _woken(self) -> None:
        # any local process can send a wake-up: wake the core only when the ledger asks
        if self.due() and self.wake():
            self.wakes += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.due() and self.wake():
                    self.wakes += 1
            except Exception:  # never let the watch end the engine; the step path remains
                log.exception("kvmem: elastic KV memory ledger watch")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
