"""``OffloadManager``: what the scheduler calls to use the CPU and disk tiers.

All methods are called from the scheduler's thread; copies run on the transfer engine's
threads. The life of a block:

1. ``offer(block_ids, keys)`` when a request finishes or is preempted: the blocks are
   held in the pool (``holder.hold``) so they are neither free nor evictable, copied to
   host memory asynchronously, and released by the ``poll()`` that sees the copy done.
   ``on_evict(block_ids, keys)`` covers cached blocks about to be reused or given back
   that no tier has yet: they are copied out at once (their pool rows are about to be
   overwritten or unmapped), into CPU tier rows or free staging rows, and written to
   disk later.
2. ``lookup(keys)`` continues a prefix hit past the device pool: the number of leading
   keys stored in the CPU tier or, failing that, on disk.
3. ``load(request_id, keys, block_ids)`` copies those blocks into newly allocated pool
   blocks. The entries are pinned so they cannot be evicted meanwhile. ``poll()`` returns
   the finished ``LoadHandle``; its first ``num_loaded`` blocks are valid, and the request
   recomputes from there on (a failed load never yields a wrong token).
4. ``shutdown()`` stops and joins the threads and releases every hold.

A full tier, a busy transfer engine or a broken disk skips the store and counts it; none
of them ever blocks compute.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

from kvmem.errors import ConfigError
from kvmem.memory.storage import KVStorage
from kvmem.tiers.blocks import copier_for, key_name
from kvmem.tiers.config import OffloadConfig, TierIdentity
from kvmem.tiers.cpu_store import CPUStore
from kvmem.tiers.disk_store import DiskStore
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.host_rows import HostRows
from kvmem.tiers.policy import make_policy
from kvmem.tiers.stats import MISSING, PrefillMeter, TierStats
from kvmem.tiers.store import BlockStore, IndexListener
from kvmem.tiers.transfer import LoadHandle, StoreJob, TransferEngine
from kvmem.units import MiB

log = logging.getLogger("kvmem.tiers")

LOAD_CHUNK_BYTES = 256 * MiB  # disk blocks read into host rows per copy into the pool


class BlockHolder(Protocol):
    """The block manager's side: keep blocks out of the free queue during a copy."""

    def hold(self, block_ids: Sequence[int]) -> None: ...

    def release(self, block_ids: Sequence[int]) -> None: ...


class OffloadManager:
    def __init__(self, config: OffloadConfig, storage: KVStorage, num_slots: int,
                 holder: BlockHolder, *, model: str, layout: str,
                 faults: Faults = NO_FAULTS, on_change: IndexListener | None = None,
                 prefill: PrefillMeter | None = None) -> None:
        """``prefill``: the engine's measured prefill rate, which values the tiers' hit
        tokens in prefill seconds saved (none: they are not valued)."""
        if not config.enabled:
            raise ConfigError("offloading needs --cpu-offload-gib or --disk-offload-gib")
        self.config = config
        self.holder = holder
        self.prefill = prefill
        self.copier = copier_for(storage, num_slots)
        slot = self.copier.slots[0]
        self.identity = TierIdentity(
            model=model, layout=layout, kv_dtype=str(slot.dtype).removeprefix("torch."),
            block_size=int(slot.shape[2]), slot_shape=tuple(int(d) for d in slot.shape[1:]),
            num_slots=num_slots)
        block_nbytes = self.copier.block_nbytes
        self.cpu = self.disk = None
        if config.cpu_bytes:
            self.cpu = CPUStore(config.cpu_bytes, block_nbytes,
                                make_policy(config.policy, config.cpu_bytes // block_nbytes),
                                pin_memory=self.copier.on_cuda, faults=faults,
                                on_change=on_change, setting=config.names.cpu_bytes)
        if config.disk_bytes:
            self.disk = DiskStore(config.disk_dir, config.disk_bytes, block_nbytes, self.identity,
                                  make_policy(config.policy, config.disk_bytes // block_nbytes),
                                  faults=faults, on_change=on_change, names=config.names)
        self.tiers: list[BlockStore] = [t for t in (self.cpu, self.disk) if t is not None]
        staging = load_rows = None
        if self.disk is not None:  # pinned once here, reused by every copy
            staging = HostRows(max(1, config.staging_bytes // block_nbytes), block_nbytes,
                               self.copier.on_cuda)
            load_rows = HostRows(max(1, LOAD_CHUNK_BYTES // block_nbytes), block_nbytes,
                                 self.copier.on_cuda)
        self.engine = TransferEngine(self.copier, self.cpu, self.disk, faults, staging,
                                     load_rows)
        self._held: Counter[int] = Counter()  # pool blocks held by stores not yet copied
        self._pending: Counter[str] = Counter()  # names with a store in flight
        self._closed = False

    # -- stores ---------------------------------------------------------------------------
    def offer(self, block_ids: Sequence[int], keys: Sequence[Hashable]) -> int:
        """Queue full, hashed blocks (of a finished or preempted request) for the tiers.

        Returns how many blocks were queued; blocks every tier already has are not copied
        again, and when too many blocks are already held for copies the rest are skipped.
        """
        if len(block_ids) != len(keys):
            raise ValueError("offer: one key per block id")
        if self._closed:
            return 0
        todo = self._not_stored(block_ids, keys)
        room = self.config.max_inflight_store_blocks - sum(self._held.values())
        if len(todo) > room:
            for tier in self.tiers:
                tier.record_skipped(len(todo) - max(room, 0))
            todo = todo[:max(room, 0)]
        if not todo:
            return 0
        ids = [b for b, _ in todo]
        names = [n for _, n in todo]
        self.holder.hold(ids)
        self._held.update(ids)
        self._pending.update(names)
        self.engine.submit_store(StoreJob(names, ids, held=True,
                                          after=self.copier.compute_done_event()))
        return len(ids)

    def on_evict(self, block_ids: Sequence[int], keys: Sequence[Hashable]) -> int:
        """Cached blocks are about to be reused or given back: keep a copy of those no tier
        has yet. Returns how many are copied.

        Called by the block pool just before eviction, once for all the blocks it
        evicts, so the copies are taken now (host memory) and written to the tiers
        asynchronously.
        """
        if self._closed:
            return 0
        todo = self._not_stored(block_ids, keys)
        if not todo:
            return 0
        names = [n for _, n in todo]
        self._pending.update(names)
        self.engine.store_now(StoreJob(names, [b for b, _ in todo], held=False,
                                       after=self.copier.compute_done_event()))
        return len(todo)

    def _not_stored(self, block_ids: Sequence[int], keys: Sequence[Hashable]
                    ) -> list[tuple[int, str]]:
        """(block, name) of the blocks some enabled tier still lacks and no copy is on its
        way to (none when no tier is enabled): one look at the tiers for the batch."""
        enabled = [t for t in self.tiers if t.enabled]
        if not enabled:
            return []
        pending = self._pending
        stored: Callable[[str], bool]
        if len(enabled) == 1:
            contains = enabled[0].contains
            stored = lambda name: name in pending or contains(name)  # noqa: E731
        else:
            stored = lambda name: name in pending or all(t.contains(name) for t in enabled)  # noqa: E731
        return [(b, name) for b, name in zip(block_ids, map(key_name, keys), strict=True)
                if not stored(name)]

    # -- lookups and loads ----------------------------------------------------------------
    def contains(self, key: Hashable) -> bool:
        """Whether an enabled tier holds ``key`` (no stats counted: ``lookup`` counts)."""
        return self.find(key) is not None

    def find(self, key: Hashable) -> str | None:
        """The first enabled tier (CPU, then disk) holding ``key``, by name; no stats."""
        name = key_name(key)
        for t in self.tiers:
            if t.enabled and t.contains(name):
                return t.name
        return None

    def record_lookups(self, loaded_from: Iterable[str], num_not_found: int) -> None:
        """Count one prefix search past the device pool: ``loaded_from`` names the tier
        each loaded block comes from (as ``find`` did); ``num_not_found`` blocks past the
        pool's hit are computed instead. A block not found is a miss in every enabled tier;
        one loaded from a tier is a hit there and a miss in the tiers consulted before it.
        """
        order = [t.name for t in self.tiers]
        hits = Counter(loaded_from)
        for t in self.tiers:
            if t.enabled:
                earlier = sum(hits[name] for name in order[order.index(t.name) + 1:])
                t.record_lookup(hits[t.name], num_not_found + earlier)

    def record_short_hit(self, found_in: Iterable[str], num_not_found: int) -> None:
        """Count a prefix search whose hit spares fewer tokens than ``min_load_tokens``: its
        blocks are recomputed. ``found_in`` names the tier each found block is in (a short
        hit there, neither hit nor miss); ``num_not_found`` as for ``record_lookups``."""
        self.record_lookups((), num_not_found)
        by_tier = Counter(found_in)
        for t in self.tiers:
            if by_tier[t.name]:
                t.record_short_hits(by_tier[t.name])

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` a tier holds (CPU first, then disk); counts hits/misses.

        Pass the keys of the blocks after the device pool's hit, and only of blocks the
        request may skip computing (never its last prompt token).
        """
        hits: Counter[str] = Counter()
        misses: Counter[str] = Counter()
        found = 0
        for key in keys:
            name = key_name(key)
            tier = None
            for t in self.tiers:
                if t.enabled and t.contains(name):
                    tier = t
                    break
                misses[t.name] += t.enabled
            if tier is None:
                break
            hits[tier.name] += 1
            found += 1
        for t in self.tiers:
            t.record_lookup(hits[t.name], misses[t.name])
        return found

    def load(self, request_id: str, keys: Sequence[Hashable], block_ids: Sequence[int],
             block_tokens: Sequence[float] | None = None) -> LoadHandle:
        """Load the blocks of ``keys`` into the newly allocated ``block_ids`` (asynchronously).

        The blocks the request computes must wait for ``handle.done`` (``poll`` returns the
        handle). Blocks evicted since ``lookup`` shorten the load; they are recomputed.
        ``block_tokens``: the prompt tokens each block stands for (default: a block's
        tokens; with several KV cache groups the caller shares them out).
        """
        if len(block_ids) != len(keys):
            raise ValueError("load: one key per block id")
        sources = []
        for key in keys:
            entry = None
            for tier in self.tiers:
                entry = tier.pin(key_name(key))
                if entry is not None:
                    sources.append((tier, entry))
                    break
            if entry is None:
                enabled = [t for t in self.tiers if t.enabled]
                if enabled:  # counted where it was looked for last
                    enabled[-1].record_failed_load(MISSING)
                break
        if block_tokens is None:
            block_tokens = [self.identity.block_size] * len(keys)
        handle = LoadHandle(request_id, list(block_ids), [key_name(k) for k in keys], sources,
                            list(block_tokens), [t.name for t, _ in sources])
        if self._closed:
            self.engine._finish_load(handle, 0, "offloading is shut down")
        else:
            self.engine.submit_load(handle)
        return handle

    # -- completion -----------------------------------------------------------------------
    def poll(self) -> list[LoadHandle]:
        """Finish transfers: release the holds of copied blocks; return finished loads."""
        self._value_hits()
        loads = []
        while not self.engine.events.empty():
            kind, job = self.engine.events.get()
            if kind == "loaded":
                loads.append(job)
            elif kind == "copied" and job.held:
                self.holder.release(job.block_ids)
                self._held.subtract(job.block_ids)
                self._held += Counter()  # drop zero counts
            elif kind == "stored":
                self._pending.subtract(job.names)
                self._pending += Counter()
        return loads

    @property
    def held_blocks(self) -> int:
        """Pool blocks held by stores whose copy has not finished (not free, not evictable)."""
        return sum(self._held.values())

    def drain(self, timeout: float = 60.0) -> list[LoadHandle]:
        """Wait until every queued transfer has finished, then ``poll``."""
        if not self.engine.wait_idle(timeout):
            log.warning("offload: transfers still running after %.0f s", timeout)
        return self.poll()

    def shutdown(self, flush: bool = False, timeout: float = 30.0) -> None:
        """Stop the workers (after finishing queued stores when ``flush``) and release holds."""
        if self._closed:
            return
        if flush:
            self.engine.wait_idle(timeout)
        self._closed = True
        stuck = self.engine.shutdown(timeout)
        self.poll()
        if self.disk is not None and not stuck:
            self.disk.close()
        if stuck:
            log.warning("offload: %s did not stop within %.0f s",
                        ", ".join(t.name for t in stuck), timeout)

    # -- metrics --------------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        self._value_hits()
        return {t.name: t.snapshot() for t in self.tiers}

    def _value_hits(self) -> None:
        rate = self.prefill.rate() if self.prefill is not None else None
        for tier in self.tiers:
            tier.value_hits(rate)
