"""Liveness of ranks that a launcher (torchrun) started, possibly on other nodes.

The driver cannot see such ranks' processes, and an idle server sends them nothing, so a
node that dies would go unnoticed until the next request. Every worker rank therefore
raises a counter in the rendezvous store (``kvmem/alive/<rank>``) every ``HEARTBEAT_S``
over a store connection of its own; the driver reads the counters and declares a rank gone
once its counter has not moved for ``SILENCE_S``. A worker whose store operation fails
(the store lives with rank 0's node: torchrun's agent there, or rank 0 itself) knows that
node is gone. Each side then stops its process with one line naming the other.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from kvmem.engine.distributed.config import ParallelConfig

HEARTBEAT_S = 1.0  # how often a worker says it is alive
SILENCE_S = 10.0  # a rank silent this long is gone (generous: a busy CPU delays threads)


def _alive_key(rank: int) -> str:
    return f"kvmem/alive/{rank}"


def _where_key(rank: int) -> str:
    return f"kvmem/where/{rank}"


def _client(parallel: ParallelConfig) -> dist.TCPStore:
    """A connection of its own to the rendezvous store, bounded by ``SILENCE_S``."""
    return dist.TCPStore(parallel.master_addr, parallel.master_port, is_master=False,
                         timeout=timedelta(seconds=SILENCE_S))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Heartbeat:
    """A worker rank's sign of life; calls ``on_lost(reason)`` once if the store is gone."""

    def __init__(self, parallel: ParallelConfig, on_lost: Callable[[str], None]) -> None:
        self._key = _alive_key(parallel.rank)
        self._store = _client(parallel)
        self._store.set(_where_key(parallel.rank), f"{socket.gethostname()} (pid {os.getpid()})")
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmem-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception as e:  # RuntimeError / DistNetworkError: the store is gone
                if not self._stop.is_set():
                    self._on_lost(first_line(e))
                return
            self._stop.wait(HEARTBEAT_S)


class PeerWatch:
    """The driver's view of every worker rank's heartbeat (thread-safe)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        self._store = _client(parallel)
        ranks = range(1, parallel.world_size)
        # every worker published this before the ranks' start-up agreement ended
        self.where = {r: self._store.get(_where_key(r)).decode() for r in ranks}
        now = time.monotonic()
        self._seen = {r: (self._count(r), now) for r in ranks}  # rank -> (count, when moved)
        self._lock = threading.Lock()

    def _count(self, rank: int) -> int:
        return self._store.add(_alive_key(rank), 0)

    def poll(self) -> None:
        """Read every counter; raises (RuntimeError) when the store itself is gone."""
        with self._lock:
            now = time.monotonic()
            for rank, (count, moved) in self._seen.items():
                latest = self._count(rank)
                self._seen[rank] = (latest, now if latest != count else moved)

    def silent(self, for_s: float = SILENCE_S) -> tuple[int, float] | None:
        """The first rank whose heartbeat has not moved for ``for_s``, and for how long."""
        with self._lock:
            now = time.monotonic()
            for rank, (_, moved) in self._seen.items():
                if now - moved >= for_s:
                    return rank, now - moved
        return None

    def wait_silent(self, for_s: float) -> tuple[int, float] | None:
        """The first rank silent for ``for_s``; None as soon as every rank's heartbeat has
        moved since the call (about ``HEARTBEAT_S`` when all are alive)."""
        start = time.monotonic()
        while True:
            with contextlib.suppress(Exception):  # the store's own failure is reported later
                self.poll()
            found = self.silent(for_s)
            if found is not None:
                return found
            with self._lock:
                if all(moved > start for _, moved in self._seen.values()):
                    return None
            if time.monotonic() - start > for_s + HEARTBEAT_S:
                return None
            time.sleep(0.1)
