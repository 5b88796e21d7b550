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

from kvmem.tiers.blocks import BlockCopier
from kvmem.tiers.cpu_store import CPUStore
from kvmem.tiers.disk_store import DiskStore
from kvmem.tiers.faults import Faults
from kvmem.tiers.host_rows import HostRows, RowRef, runs
from kvmem.tiers.stats import ERROR
from kvmem.tiers.store import BlockStore, Entry, LoadError

log = logging.getLogger("kvmem.tiers")

STAGING_WAIT_S = 10.0  # longest a store waits for the disk writer to free a staging row


@dataclass(eq=False)
class StoreJob:
    """Blocks on their way from the pool to the tiers."""

    names: list[str]
    block_ids: list[int]
    held: bool  # True: block_ids are held in the pool until the copy is done
    after: Any = None  # CUDA event the copy waits for


@dataclass(eq=False)
class DiskWrite:
    """Host rows for the disk writer, and what it lets go once they are written: CPU tier
    entries pinned while it reads their rows, and staging rows it gives back."""

    job: StoreJob
    blocks: list[tuple[str, RowRef]] = field(default_factory=list)
    pinned: list[Entry] = field(default_factory=list)
    staging: list[int] = field(default_factory=list)
    last: bool = True  # the job's last write: "stored" is reported after it
    num_copied: int = 0  # how many of the names given to ``_copy_out`` it dealt with


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
    """The copies' two threads. ``staging``: host rows for blocks the CPU tier does not
    take on their way to the disk tier (and eviction snapshots); ``load_rows``: the rows
    disk blocks are read into before their copy into the pool. Both are needed only with
    a disk tier; the CPU tier's blocks are copied straight to and from its own rows."""

    def __init__(self, copier: BlockCopier, cpu: CPUStore | None, disk: DiskStore | None,
                 faults: Faults, staging: HostRows | None = None,
                 load_rows: HostRows | None = None,
                 staging_wait_s: float = STAGING_WAIT_S) -> None:
        if disk is not None and (staging is None or load_rows is None):
            raise ValueError("a disk tier needs staging and load rows")
        self.copier = copier
        self.cpu = cpu
        self.disk = disk
        self.faults = faults
        self.staging = staging
        self.load_rows = load_rows
        self.staging_wait_s = staging_wait_s
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._loads: deque[LoadHandle] = deque()
        self._stores: deque[StoreJob] = deque()
        self._disk_writes: deque[DiskWrite] = deque()
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

    def store_now(self, job: StoreJob) -> None:
        """Copy ``job``'s blocks out of the pool before returning (an eviction snapshot:
        the pool block is about to be reused), into CPU tier rows or free staging rows
        (none free: the disk tier skips it); the disk write runs later."""
        try:
            write = self._copy_out(job, job.names, job.block_ids, wait=False)
        except Exception:  # noqa: BLE001 - a store must never take the engine down
            log.exception("offload: copying a block out of the KV pool failed")
            write = DiskWrite(job)
        self._queue_disk_write(write)

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
            writes = list(self._disk_writes)
            self._loads.clear()
            self._stores.clear()
            self._disk_writes.clear()
        for write in writes:
            self._written(write)
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

    def _run_queued_loads(self) -> None:
        """Run the loads waiting now (a store waiting for staging rows lets them go first)."""
        while True:
            with self._cv:
                if not self._loads or self._stopping:
                    return
                handle = self._loads.popleft()
            self._run_load(handle)

    def _disk_loop(self) -> None:
        while (write := self._next(self._disk_writes)) is not None:
            try:
                for name, (rows, index) in write.blocks:
                    self.disk.put(name, rows.row(index))
            except Exception:  # noqa: BLE001 - a store must never take the engine down
                log.exception("offload: disk store failed")
            finally:
                self._written(write)
                self._done()

    def _written(self, write: DiskWrite) -> None:
        """The disk writer is done with ``write``'s rows: let them go."""
        for entry in write.pinned:
            self.cpu.unpin(entry)
        if write.staging:
            self.staging.give_back(write.staging)
        if write.last:
            self.events.put(("stored", write.job))

    def _queue_disk_write(self, write: DiskWrite) -> None:
        if not write.blocks:
            self._written(write)
            return
        with self._cv:
            self._disk_writes.append(write)
            self._cv.notify_all()

    # -- stores ---------------------------------------------------------------------------
    def _run_store(self, job: StoreJob) -> None:
        names, block_ids = job.names, job.block_ids
        try:
            self.faults.before_store()
            while True:  # more than one round when the disk's blocks outnumber staging rows
                start = time.perf_counter()
                write = self._copy_out(job, names, block_ids, wait=True)
                # the copy out of the KV cache counts for the first tier the blocks reach
                (self.cpu if self.cpu is not None else self.disk).record_store_time(
                    time.perf_counter() - start)
                names, block_ids = names[write.num_copied:], block_ids[write.num_copied:]
                write.last = not names
                self._queue_disk_write(write)
                if not names:
                    break
        except Exception:  # noqa: BLE001
            log.exception("offload: copying blocks out of the KV pool failed")
            self.events.put(("stored", job))
        self.events.put(("copied", job))

    def _copy_out(self, job: StoreJob, names: list[str], block_ids: list[int],
                  wait: bool) -> DiskWrite:
        """Copy blocks out of the pool, in one copy: each into its own CPU tier row when
        the CPU tier takes it, else into a staging row when the disk tier lacks it. Stops
        at the first block needing a staging row when none is free (``wait``: after
        waiting up to ``staging_wait_s`` for the disk writer to free one; else the block
        is skipped); ``num_copied`` on the result says how many of ``names`` were dealt
        with. Returns the disk writer's share."""
        write = DiskWrite(job, last=False)
        reserved: list[tuple[Entry, bool]] = []  # CPU tier entries and whether the disk wants them
        refs: list[RowRef] = []
        ids: list[int] = []
        done = 0
        for name, block_id in zip(names, block_ids, strict=True):
            to_disk = self.disk is not None and self.disk.enabled and not self.disk.contains(name)
            entry = self.cpu.reserve(name) if self.cpu is not None else None
            if entry is not None:
                reserved.append((entry, to_disk))
                refs.append(self.cpu.ref(entry))
                ids.append(block_id)
            elif to_disk and self.cpu is not None and (held := self.cpu.pin(name)):
                write.pinned.append(held)  # the CPU tier has it: the disk copies its row
                write.blocks.append((name, self.cpu.ref(held)))
            elif to_disk:
                rows = self._take_staging(wait and not refs)
                if not rows and wait and refs:
                    break  # copy what is gathered; the rest waits for the next round
                if not rows:
                    wait = False  # none came back in time: the rest skip the disk too
                    self.disk.record_skipped(1)
                else:
                    write.staging.append(rows[0])
                    write.blocks.append((name, (self.staging, rows[0])))
                    refs.append((self.staging, rows[0]))
                    ids.append(block_id)
            done += 1
        write.num_copied = done
        try:
            if ids:
                self.copier.gather(ids, runs(refs), job.after)
        except BaseException:
            for entry, _ in reserved:
                self.cpu.abort(entry)
            write.blocks.clear()
            self._written(write)  # its rows only: the caller reports the job
            raise
        for entry, to_disk in reserved:
            if self.cpu.commit(entry, 0.0, pin=to_disk) and to_disk:
                write.pinned.append(entry)
                write.blocks.append((entry.name, self.cpu.ref(entry)))
        return write

    def _take_staging(self, wait: bool) -> list[int]:
        """One staging row; ``wait``: up to ``staging_wait_s`` for the disk writer to give
        one back, running the loads that arrive meanwhile."""
        deadline = time.monotonic() + (self.staging_wait_s if wait else 0.0)
        while True:
            rows = self.staging.take(1)
            if rows or time.monotonic() >= deadline or self._stopping:
                return rows
            self._run_queued_loads()
            rows = self.staging.take(1, timeout=min(0.05, self.staging_wait_s))
            if rows:
                return rows

    # -- loads ----------------------------------------------------------------------------
    def _run_load(self, handle: LoadHandle) -> None:
        """Copy the handle's blocks into the pool, a chunk at a time: CPU tier blocks
        straight from their rows, disk blocks through ``load_rows``."""
        loaded, error = 0, None
        read_seconds: list[float] = []
        scatter_seconds = 0.0
        sources = handle.sources
        chunk = self.load_rows.num_rows if self.load_rows is not None else len(sources)
        try:
            while loaded < len(sources) and error is None:
                refs: list[RowRef] = []
                for store, entry in sources[loaded:loaded + max(chunk, 1)]:
                    start = time.perf_counter()
                    out = None if store.in_place else self.load_rows.row(len(refs))
                    try:
                        store.read(entry, out)
                    except LoadError as exc:
                        error = str(exc)
                        break
                    read_seconds.append(time.perf_counter() - start)
                    refs.append(store.ref(entry) if store.in_place
                                else (self.load_rows, len(refs)))
                with handle.scatter_lock:
                    if handle.cancelled:
                        loaded, error = 0, "cancelled"
                        break
                    if refs:
                        start = time.perf_counter()
                        self.copier.scatter(handle.block_ids[loaded:loaded + len(refs)],
                                            runs(refs))
                        scatter_seconds += time.perf_counter() - start
                        loaded += len(refs)
            if loaded:
                self._record_loaded(handle, read_seconds[:loaded], scatter_seconds)
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
