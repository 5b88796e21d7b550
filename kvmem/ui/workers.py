"""Plans computed in worker processes, each against a deadline and a memory cap.

The planner's searches grow with a model's layers and a layout's stages, and a name the
catalog lacks is read from the Hugging Face Hub; a request the server's own threads
computed would hold the interpreter while it ran. Here each request's plan goes to one of
a few worker processes (``limits.PLAN_WORKERS``, started fresh with ``spawn``: a server
with threads is never forked): one running past ``limits.PLAN_SECONDS`` is killed and
replaced, and its request refused in one line; a worker's address space is capped, so a
plan that would exhaust the host fails alone. Its answer comes back as a plain dict.
"""

from __future__ import annotations

import multiprocessing
import queue
import resource
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from kvmem.ui import limits
from kvmem.ui.query import QueryError
from kvmem.units import format_bytes

# an answer from a worker: ("ok", document) | ("refused", (message, field)) | ("failed", line)
Answer = tuple[str, object]


def _serve(conn: Connection, memory_bytes: int) -> None:
    """A worker's loop: (endpoint, query) in, its answer out, until the pipe closes."""
    from kvmem.ui.view import ENDPOINTS

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops us
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while True:
        try:
            endpoint, query = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            answer: Answer = ("ok", ENDPOINTS[endpoint](query))
        except QueryError as e:
            answer = ("refused", (str(e), e.field))
        except MemoryError:
            answer = ("refused", (f"this plan needs more than {format_bytes(memory_bytes)} "
                                  "of memory to compute, the page's limit", None))
        except Exception as e:  # a planner bug: one line to the page, the trace to the log
            traceback.print_exc(file=sys.stderr)
            answer = ("failed", f"internal error: {type(e).__name__}: {e}")
        conn.send(answer)


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection

    def stop(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class Busy(Exception):
    """Every worker stayed busy for a whole deadline."""


class PlanWorkers:
    """A fixed set of worker processes; ``ask`` waits for a free one."""

    def __init__(self, count: int = limits.PLAN_WORKERS,
                 seconds: float = limits.PLAN_SECONDS,
                 memory_bytes: int = limits.PLAN_MEMORY_BYTES):
        self.seconds, self.memory_bytes = seconds, memory_bytes
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(count):
            self._idle.put(self._start())

    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(theirs, self.memory_bytes),
                                        name="kvmem-ui-plan", daemon=True)
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        with self._lock:
            self._all.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> _Worker:
        with self._lock:
            self._all.discard(worker)
        worker.stop()
        return worker if self._closed else self._start()

    def ask(self, endpoint: str, query: str) -> Answer:
        """The answer of ``ENDPOINTS[endpoint](query)``, computed in a worker; a plan past
        the deadline is ("refused", ...), all workers busy past it raises Busy."""
        try:
            worker = self._idle.get(timeout=self.seconds)
        except queue.Empty:
            raise Busy from None
        try:
            worker.conn.send((endpoint, query))
            if worker.conn.poll(self.seconds):
                return worker.conn.recv()
            worker = self._replace(worker)
            return ("refused", (f"this plan took longer than {self.seconds:g} s to compute, "
                                "the page's limit (the search grows with layers and pipeline "
                                "stages); `kvmem plan` on the command line has none", None))
        except (EOFError, OSError):  # the worker died (killed from outside, or its memory)
            worker = self._replace(worker)
            return ("failed", "internal error: the plan's worker process ended")
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.stop()

