"""The bookkeeping every tier shares: a byte budget, an index, pins and eviction.

A tier maps block names (``blocks.key_name``) to entries. An entry is written outside the
lock and becomes visible only once its bytes are complete, so a lookup never finds a
half-written block. A load pins its entries first, and a pinned entry is never evicted;
an entry that fails to load leaves the index at once and gives its space back when the
last pin goes. ``used_bytes`` is the exact sum of the entries' sizes at every moment.

The lock guards only memory: the scheduler's thread takes it (``pin``, ``record_lookup``),
so no file-system call runs under it. What an entry frees under the lock (a disk tier's
file) is let go by ``_after_unlock``, on the thread that freed it (a tier thread), once
the lock is released.

An optional ``on_change(tier, name, present)`` hears every change of the index (a block
becoming readable, or leaving), under the tier's lock: a process that cannot see the
tier (vLLM's scheduler, beside a worker's tiers) keeps its own view of it from these.

Subclasses supply ``_entry_bytes``, ``_allocate``, ``_write``, ``_read`` and ``_release``.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvmem.tiers import stats as causes
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.policy import LRUPolicy
from kvmem.tiers.stats import TierStats

log = logging.getLogger("kvmem.tiers")

IndexListener = Callable[[str, str, bool], None]  # (tier name, block name, now present)


class LoadError(Exception):
    """A stored block could not be read back intact; ``cause`` is one of
    ``kvmem.tiers.stats.FAILED_LOAD_CAUSES``."""

    def __init__(self, message: str, cause: str = causes.FORMAT) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(eq=False)
class Entry:
    name: str
    nbytes: int
    handle: Any  # where the bytes are: an arena row (CPU) or a file path (disk)
    pins: int = 0
    ready: bool = False
    dropped: bool = False
    fresh: bool = True  # stored by this process (not found on disk at start-up)
    loads: int = 0


class BlockStore(ABC):
    name = "tier"
    in_place = False  # True: entries are host rows, read where they are (``read(e, None)``)

    def __init__(self, capacity_bytes: int, policy: LRUPolicy, faults: Faults = NO_FAULTS,
                 on_change: IndexListener | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.on_change = on_change
        self.faults = faults
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._policy = policy
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._used = 0
        self._enabled = True
        self._unvalued_tokens = 0.0  # hit tokens not yet turned into prefill seconds

    # -- queries (any thread) -------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return sum(e.ready for e in self._entries.values())

    def contains(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.ready

    def snapshot(self) -> TierStats:
        with self._lock:
            self.stats.used_bytes = self._used
            self.stats.used_blocks = len(self)
            self.stats.capacity_blocks = self.capacity_bytes // self.entry_nbytes
            self.stats.enabled = self._enabled
            return TierStats(**self.stats.as_dict())

    def record_lookup(self, hits: int, misses: int) -> None:
        with self._lock:
            self.stats.lookups += hits + misses
            self.stats.hits += hits
            self.stats.misses += misses

    def record_short_hits(self, num_blocks: int) -> None:
        with self._lock:
            self.stats.short_hits += num_blocks

    def record_loaded(self, num_blocks: int, tokens: float, seconds: float) -> None:
        """Count blocks loaded intact into the KV cache: the prompt ``tokens`` they stand
        for (valued by ``value_hits``) and ``seconds`` of copying into the cache."""
        with self._lock:
            self.stats.loaded_blocks += num_blocks
            self.stats.hit_tokens += tokens
            self.stats.load_seconds += seconds
            self._unvalued_tokens += tokens

    def value_hits(self, prefill_rate: float | None) -> None:
        """Turn the hit tokens counted since the last call into the prefill seconds they
        saved, at the engine's measured ``prefill_rate`` (tokens/s); kept for later while
        no rate is known yet (a restarted engine's first requests load before it computes)."""
        if not prefill_rate:
            return
        with self._lock:
            self.stats.prefill_saved_seconds += self._unvalued_tokens / prefill_rate
            self._unvalued_tokens = 0.0

    def record_store_time(self, seconds: float) -> None:
        with self._lock:
            self.stats.store_seconds += seconds

    def record_failed_load(self, cause: str) -> None:
        with self._lock:
            self.stats.record_failed_load(cause)

    def record_skipped(self, num_blocks: int) -> None:
        """Count stores dropped before they reached this tier (e.g. too much already queued)."""
        with self._lock:
            self.stats.skipped_stores += num_blocks

    # -- loads ----------------------------------------------------------------------------
    def pin(self, name: str) -> Entry | None:
        """Keep ``name`` from eviction until ``unpin``; None when it is not (or no longer) here."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or not entry.ready:
                return None
            entry.pins += 1
            self._policy.touched(name)
            return entry

    def unpin(self, entry: Entry) -> None:
        with self._changing():
            entry.pins -= 1
            if entry.dropped and entry.pins == 0:
                self._free(entry)

    def read(self, entry: Entry, out: torch.Tensor | None) -> None:
        """Copy a pinned entry into the host row ``out``; raises LoadError and drops the entry
        when its bytes are missing or damaged. With ``out`` None (a tier ``in_place``, whose
        rows are host memory) nothing is copied: the caller reads the row where it is,
        while the entry is pinned."""
        try:
            if not self._enabled:
                raise LoadError(f"{self.name} tier is disabled", causes.DISABLED)
            self.faults.before_read()
            if out is not None:
                self._read(entry, out)
        except (LoadError, OSError) as exc:
            cause = exc.cause if isinstance(exc, LoadError) else \
                causes.MISSING if isinstance(exc, FileNotFoundError) else causes.IO
            with self._changing():
                self.stats.record_failed_load(cause)
                self._forget(entry)
            if isinstance(exc, OSError):
                self._io_failed(exc)
            raise LoadError(f"{self.name} tier: block {entry.name}: {exc}", cause) from exc
        with self._lock:
            self.stats.bytes_loaded += entry.nbytes
            if entry.loads == 0 and entry.fresh:
                self.stats.unused_blocks -= 1
            entry.loads += 1

    # -- stores ---------------------------------------------------------------------------
    def put(self, name: str, row: torch.Tensor) -> bool:
        """Store one host row under ``name``; False (and counted) when it was not stored."""
        entry = self.reserve(name)
        if entry is None:
            return name in self._entries  # already here (or being written): True
        start = time.perf_counter()
        try:
            self._write(entry, row)
        except OSError as exc:
            self.abort(entry)
            self._io_failed(exc)
            return False
        return self.commit(entry, time.perf_counter() - start)

    def reserve(self, name: str) -> Entry | None:
        """Room for ``name``, not yet visible to lookups: its bytes are written next
        (``put``, or a copy straight into the CPU tier's row) and ``commit`` publishes
        them. None when the block is already here (touched) or is not stored (counted)."""
        with self._changing():
            if not self._enabled:
                self.stats.skipped_stores += 1
                return None
            if name in self._entries:
                self._policy.touched(name)
                return None
            if not self._policy.admit(name):
                self.stats.not_admitted += 1
                return None
            nbytes = self._entry_bytes(name)
            if not self._make_room(nbytes):
                self.stats.skipped_stores += 1
                return None
            entry = Entry(name, nbytes, self._allocate(name))
            self._entries[name] = entry
            self._used += nbytes
            return entry

    def commit(self, entry: Entry, seconds: float, pin: bool = False) -> bool:
        """A reserved entry's bytes are complete: make it visible. ``pin``: keep it from
        eviction until ``unpin`` (the disk writer reads it next). False when the tier
        was disabled meanwhile."""
        with self._lock:
            if entry.dropped:
                return False
            entry.ready = True
            entry.pins += pin
            self._policy.inserted(entry.name)
            if self.on_change is not None:
                self.on_change(self.name, entry.name, True)
            self.stats.stored_blocks += 1
            self.stats.bytes_stored += entry.nbytes
            self.stats.store_seconds += seconds
            self.stats.unused_blocks += 1
        return True

    def abort(self, entry: Entry) -> None:
        """A reserved entry's bytes could not be written: give its room back (counted)."""
        with self._changing():
            self.stats.skipped_stores += 1
            self._forget(entry)

    def disable(self, reason: str) -> None:
        """Stop using this tier (e.g. its directory vanished); its entries are forgotten."""
        with self._changing():
            if not self._enabled:
                return
            self._enabled = False
            for entry in list(self._entries.values()):
                self._forget(entry)
        log.warning("%s offload tier disabled: %s", self.name, reason)

    # -- internals (lock held) ------------------------------------------------------------
    @contextmanager
    def _changing(self) -> Iterator[None]:
        """The lock, for a change that may free entries; what they free is let go after."""
        with self._lock:
            yield
        self._after_unlock()

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.capacity_bytes:
            return False
        for name in self._policy.victims():
            if self._used + nbytes <= self.capacity_bytes:
                break
            entry = self._entries[name]
            if entry.pins == 0:
                self._forget(entry)
                self.stats.evictions += 1
        return self._used + nbytes <= self.capacity_bytes

    def _forget(self, entry: Entry) -> None:
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
            self._policy.removed(entry.name)
            if entry.ready and self.on_change is not None:
                self.on_change(self.name, entry.name, False)
            if entry.ready and entry.fresh and entry.loads == 0:
                self.stats.unused_blocks -= 1
                self.stats.wasted_blocks += 1
        if not entry.dropped:
            entry.dropped = True
            if entry.pins == 0:
                self._free(entry)

    def _free(self, entry: Entry) -> None:
        self._used -= entry.nbytes
        self._release(entry)

    # -- subclass hooks -------------------------------------------------------------------
    def _io_failed(self, exc: OSError) -> None:  # noqa: B027 - optional hook
        """Called (lock not held) after an OSError; a tier may disable itself here."""

    def _after_unlock(self) -> None:  # noqa: B027 - optional hook
        """Called (lock not held) after a change that may have freed entries: let go of
        what ``_release`` set aside (a disk tier removes the files here)."""

    @property
    @abstractmethod
    def entry_nbytes(self) -> int:
        """What one block takes in this tier (a disk block's file with its header)."""

    @abstractmethod
    def _entry_bytes(self, name: str) -> int:
        ...

    @abstractmethod
    def _allocate(self, name: str) -> Any:
        ...

    @abstractmethod
    def _write(self, entry: Entry, row: torch.Tensor) -> None:
        ...

    @abstractmethod
    def _read(self, entry: Entry, out: torch.Tensor) -> None:
        ...

    @abstractmethod
    def _release(self, entry: Entry) -> None:
        """Give an entry's space back (lock held: memory only; see ``_after_unlock``)."""
