"""Asynchronous copies between the KV pool and the tiers, with completion events.

Two worker threads:

- the *transfer* thread copies blocks out of the pool into host rows (then into the CPU
  tier) and loads tier blocks into the pool; pending loads always go before pending
  stores, since a request waits for them;
- the *disk writer* writes host rows to the disk tier, so slow disks never delay loads.

Every finished step is reported on an event queue that the scheduler's thread drains
(``OffloadManager.poll``); only that thread touches the block manager, so holds are
taken and released there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmem.tiers.blocks import BlockCopier
from kvmem.tiers.cpu_store import CPUStore
from kvmem.tiers.disk_store import DiskStore
from kvmem.tiers.faults import Faults
from kvmem.tiers.stats import ERROR
from kvmem.tiers.store import BlockStore, Entry, LoadError

log = logging.getLogger("kvmem.tiers")


@dataclass(eq=False)
class StoreJob:
    """Blocks on their way from the pool to the tiers."""

    names: list[str]
    block_ids: list[int]
    held: bool  # True: block_ids are held in the pool until the copy is done
    rows: torch.Tensor | None = None  # host rows; given up front for eviction snapshots
    after: Any = None  # CUDA event the copy waits for


@dataclass(eq=False)
class LoadHandle:
    """A load of tier blocks into newly allocated pool blocks.

    When ``done`` is set, the first ``num_loaded`` of ``block_ids`` hold their blocks'
    KV; the rest (after a failed or missing block) must be recomputed. ``error`` says why
    a load stopped short. ``tiers`` names the tier each found block loads from;
    ``block_tokens`` the prompt tokens each block stands for (counted as its tier's hit
    tokens once it is loaded intact). ``cancel()`` gives it up: nothing is written into the
    pool after it returns.
    """

    request_id: str
    block_ids: list[int]
    names: list[str]
    sources: list[tuple[BlockStore, Entry]]
    block_tokens: list[float]
    tiers: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    num_loaded: int = 0
    error: str | None = None
    cancelled: bool = False
    scatter_lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Give the load up (a caller that stopped waiting for it, and recomputes its
        blocks): a copy into the pool under way is waited for, and a read still stuck in
        the file system writes nothing into the pool when it ends, so the blocks, reused
        meanwhile, are never overwritten with this load's bytes."""
        with self.scatter_lock:
            self.cancelled = True

    @property
    def ok(self) -> bool:
        return self.done.is_set() and self.num_loaded == len(self.block_ids)


class TransferEngine:
    def __init__(self, copier: BlockCopier, cpu: CPUStore | None, disk: DiskStore | None,
                 faults: Faults, max_disk_queue_bytes: int) -> None:
        self.copier = copier
        self.cpu = cpu
        self.disk = disk
        self.faults = faults
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._loads: deque[LoadHandle] = deque()
        self._stores: deque[StoreJob] = deque()
        self._disk_writes: deque[StoreJob] = deque()
        self._disk_queue_bytes = 0
        self._max_disk_queue_bytes = max_disk_queue_bytes
        self._busy = 0
        self._stopping = False
        self._threads = [threading.Thread(target=self._transfer_loop, name="kvmem-offload",
                                          daemon=True)]
        if disk is not None:
            self._threads.append(threading.Thread(target=self._disk_loop, name="kvmem-disk-writer",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    # -- submission (scheduler thread) ----------------------------------------------------
    def submit_store(self, job: StoreJob) -> None:
        with self._cv:
            self._stores.append(job)
            self._cv.notify_all()

    def submit_load(self, handle: LoadHandle) -> None:
        with self._cv:
            self._loads.append(handle)
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return not (self._loads or self._stores or self._disk_writes or self._busy)

    def wait_idle(self, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(
                lambda: not (self._loads or self._stores or self._disk_writes or self._busy),
                timeout)

    def shutdown(self, timeout: float) -> list[threading.Thread]:
        """Stop the workers; work not started is reported as dropped. Returns threads still
        alive after ``timeout`` (normally none)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        with self._cv:
            for handle in self._loads:
                self._finish_load(handle, 0, "the offload engine shut down before the load ran")
            for job in self._stores:
                self.events.put(("copied", job))
                self.events.put(("stored", job))
            for job in self._disk_writes:
                self.events.put(("stored", job))
            self._loads.clear()
            self._stores.clear()
            self._disk_writes.clear()
        return [t for t in self._threads if t.is_alive()]

    # -- workers --------------------------------------------------------------------------
    def _next(self, *queues: deque) -> Any:
        with self._cv:
            self._cv.wait_for(lambda: self._stopping or any(queues))
            if self._stopping:
                return None
            self._busy += 1
            return next(q for q in queues if q).popleft()

    def _done(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def _transfer_loop(self) -> None:
        while (job := self._next(self._loads, self._stores)) is not None:
            try:
                if isinstance(job, LoadHandle):
                    self._run_load(job)
                else:
                    self._run_store(job)
            finally:
                self._done()

    def _disk_loop(self) -> None:
        while (job := self._next(self._disk_writes)) is not None:
            try:
                for name, row in zip(job.names, job.rows, strict=True):
                    self.disk.put(name, row)
            except Exception:  # noqa: BLE001 - a store must never take the engine down
                log.exception("offload: disk store failed")
            finally:
                with self._cv:
                    self._disk_queue_bytes -= job.rows.numel()
                self.events.put(("stored", job))
                self._done()

    def _run_store(self, job: StoreJob) -> None:
        try:
            if job.rows is None:
                self.faults.before_store()
                start = time.perf_counter()
                job.rows = self.copier.alloc_host(len(job.block_ids))
                self.copier.gather(job.block_ids, job.rows, job.after)
                # the copy out of the KV cache counts for the first tier the blocks reach
                first = self.cpu if self.cpu is not None else self.disk
                first.record_store_time(time.perf_counter() - start)
        except Exception:  # noqa: BLE001
            log.exception("offload: copying blocks out of the KV pool failed")
            self.events.put(("copied", job))
            self.events.put(("stored", job))
            return
        self.events.put(("copied", job))
        if self.cpu is not None:
            for name, row in zip(job.names, job.rows, strict=True):
                self.cpu.put(name, row)
        if self.disk is not None and self.disk.enabled:
            with self._cv:
                fits = self._disk_queue_bytes + job.rows.numel() <= self._max_disk_queue_bytes
                if fits:
                    self._disk_queue_bytes += job.rows.numel()
                    self._disk_writes.append(job)
                    self._cv.notify_all()
            if fits:
                return
            self.disk.record_skipped(len(job.names))
        self.events.put(("stored", job))

    def _run_load(self, handle: LoadHandle) -> None:
        loaded, error = 0, None
        read_seconds: list[float] = []
        try:
            rows = self.copier.alloc_host(len(handle.sources))
            for row, (store, entry) in zip(rows, handle.sources, strict=True):
                start = time.perf_counter()
                try:
                    store.read(entry, row)
                except LoadError as exc:
                    error = str(exc)
                    break
                read_seconds.append(time.perf_counter() - start)
                loaded += 1
            with handle.scatter_lock:
                if handle.cancelled:
                    loaded, error = 0, "cancelled"
                elif loaded:
                    start = time.perf_counter()
                    self.copier.scatter(handle.block_ids[:loaded], rows[:loaded])
                    self._record_loaded(handle, read_seconds, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - report as a failed load, recompute instead
            log.exception("offload: loading blocks into the KV pool failed")
            if handle.sources:
                handle.sources[0][0].record_failed_load(ERROR)
            loaded, error = 0, f"load failed: {exc}"
        self._finish_load(handle, loaded, error)

    @staticmethod
    def _record_loaded(handle: LoadHandle, read_seconds: list[float],
                       scatter_seconds: float) -> None:
        """Count the blocks loaded intact, per tier: each its read and its share of the
        copy into the KV cache (one copy for all, the same work per block)."""
        per_block = scatter_seconds / len(read_seconds)
        per_tier: dict[BlockStore, list[float]] = {}
        for (store, _), tokens, seconds in zip(handle.sources, handle.block_tokens,
                                               read_seconds, strict=False):
            totals = per_tier.setdefault(store, [0, 0.0, 0.0])
            totals[0] += 1
            totals[1] += tokens
            totals[2] += seconds + per_block
        for store, (blocks, tokens, seconds) in per_tier.items():
            store.record_loaded(int(blocks), tokens, seconds)

    def _finish_load(self, handle: LoadHandle, loaded: int, error: str | None) -> None:
        for store, entry in handle.sources:
            store.unpin(entry)
        handle.sources = []
        handle.num_loaded = loaded
        if error is None and loaded < len(handle.block_ids):
            error = "some blocks were no longer stored"
        handle.error = error
        self.events.put(("loaded", handle))
        handle.done.set()
