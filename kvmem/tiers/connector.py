"""``OffloadConnector``: the tiers in the scheduler's terms (requests and block tables).

It sits between a ``kvmem.cache.KVCacheManager`` and an ``OffloadManager`` and needs only
duck-typed requests (``request_id``, ``all_token_ids``, ``num_tokens``). The scheduler
keeps its requests (those waiting for a load too) and calls the connector at four points:

- ``offer(request)`` just before ``kv_cache_manager.free(request)`` (finish, preempt,
  abort): the request's cached blocks are held and copied to the tiers;
- ``start_load(request, hit)`` when admitting a waiting request, after the device pool's
  prefix hit: if the pool and the tiers together give a longer hit, blocks for it are
  allocated (all or nothing) and the load starts (True is returned: the scheduler holds
  the request back until the load is reported done);
- ``poll()`` at the start of every step: finishes transfers and reports each load that is
  done as (request id, computed tokens): how far the request's KV is now valid;
- ``cancel(request_id)`` for a request whose load is in flight and that is aborted: it
  never waits for the load (a tier's file-system call must not stop the step); the blocks
  the load writes into stay held until it is done.

The hit must be valid for every KV group, by each group's own rule (``kvmem.cache``'s
managers, here looking blocks up in the pool and then the tiers): full attention needs
every block of the prefix, a sliding-window or chunked group only the blocks its window
sees at the hit length (null blocks before). Blocks to load enter the block table as
``LOAD_BLOCK`` entries of the hit, so they are not findable by hash until the request's
next tokens are scheduled, after the load: no other request can read a block whose bytes
are still on their way. When a block fails, the blocks that loaded intact are made
findable, the request's blocks are freed, and its hit is looked up again (pool, then
tiers, where the failed block no longer is): it goes on from the longest length still
valid for every group. The pool's
``evict_listener`` is pointed at ``OffloadManager.on_evict``, so cached blocks reused for
new data, or evicted to give their memory back, are kept too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from kvmem.cache.block_pool import Evicted
from kvmem.cache.coordinator import LOAD_BLOCK, longest_common_hit
from kvmem.cache.hashing import BlockHash
from kvmem.cache.managers import SingleTypeManager, make_manager
from kvmem.cache.results import PrefixHit
from kvmem.spec.layout import AttentionKind
from kvmem.tiers.manager import OffloadManager
from kvmem.tiers.stats import block_tokens
from kvmem.tiers.transfer import LoadHandle

log = logging.getLogger("kvmem.tiers")

Position = tuple[int, int]  # (block index, group)
MAX_REMEMBERED_LOOKUPS = 1024


class _PoolThenTiers:
    """One group's blocks by hash for a hit: the pool's cached block, else ``LOAD_BLOCK``
    when a tier holds it, else None (the ``get`` a manager's hit search calls). Each block
    looked up past the pool goes into ``found`` with the tier holding it (or None)."""

    def __init__(self, group_id: int, pool_blocks: dict[BlockHash, int],
                 offload: OffloadManager, found: dict[Any, str | None]) -> None:
        self.group_id = group_id
        self.pool_blocks = pool_blocks
        self.offload = offload
        self.found = found

    def get(self, block_hash: BlockHash) -> int | None:
        block_id = self.pool_blocks.get(block_hash)
        if block_id is not None:
            return block_id
        key = (self.group_id, block_hash)
        if key not in self.found:
            self.found[key] = self.offload.find(key)
        return LOAD_BLOCK if self.found[key] is not None else None


class OffloadConnector:
    def __init__(self, offload: OffloadManager, kv_cache_manager: Any) -> None:
        self.offload = offload
        self.kv = kv_cache_manager
        self.block_size: int = kv_cache_manager.block_size
        # loads in flight: the request, its load, and the (block, group) of each loaded block
        self._loads: dict[str, tuple[Any, LoadHandle, list[Position]]] = {}
        # (request id, length) of the latest searches already counted in the tiers' stats
        self._looked_up: OrderedDict[tuple[str, int], None] = OrderedDict()
        # the groups whose loaded blocks count as hit tokens: those holding every position
        every = [g for g, group in enumerate(kv_cache_manager.groups)
                 if group.kind in (AttentionKind.FULL, AttentionKind.MLA)]
        self._counted = every or list(range(len(kv_cache_manager.groups)))
        # loads of cancelled requests still running: their blocks are held until done
        self._abandoned: set[LoadHandle] = set()
        kv_cache_manager.pool.evict_listener = self._on_evict

    def _on_evict(self, evicted: list[Evicted]) -> None:
        self.offload.on_evict([b for b, _, _ in evicted], [(g, h) for _, g, h in evicted])

    def _managers(self, lookups: list[Any]) -> list[SingleTypeManager]:
        """Each group's hit rule over ``lookups[g]`` instead of the pool's cache."""
        return [make_manager(group, g, self.block_size, lookups[g])
                for g, group in enumerate(self.kv.groups)]

    # -- stores ---------------------------------------------------------------------------
    def offer(self, request: Any) -> int:
        """Offer the request's cached blocks to the tiers; call before freeing them."""
        pool = self.kv.pool
        ids, keys = [], []
        for g, table in enumerate(self.kv.get_block_ids(request.request_id)):
            for block_id in table:
                block_hash = pool.block_hash[block_id] if block_id else None
                if block_hash is not None and pool.block_group[block_id] == g:
                    ids.append(block_id)
                    keys.append((g, block_hash))
        return self.offload.offer(ids, keys) if ids else 0

    # -- loads ----------------------------------------------------------------------------
    def start_load(self, request: Any, hit: PrefixHit) -> bool:
        """Continue ``hit`` (the device pool's ``PrefixHit``) from the tiers; True if a load
        started (the request's blocks are allocated; ``poll`` reports when it is done).
        False: admit it as usual."""
        if request.request_id in self._loads:
            return False
        bs = self.block_size
        end = (request.num_tokens - 1) // bs  # always leave a prompt token to compute
        if end <= hit.num_tokens // bs:
            return False
        hashes = self.kv.request_block_hashes(request, end)
        found: dict[Any, str | None] = {}
        lookups = [_PoolThenTiers(g, self.kv.pool.cached[g], self.offload, found)
                   for g in range(len(self.kv.groups))]
        length, blocks = longest_common_hit(self._managers(lookups), hashes, end)
        loads = [(i, g) for i in range(length) for g, table in enumerate(blocks)
                 if table[i] == LOAD_BLOCK]
        keys = [(g, hashes[i]) for i, g in loads]
        first = self._first_lookup(request)
        # blocks past the pool's hit the request computes: misses in every tier
        not_found = (end - max(length, hit.num_tokens // bs)) * len(blocks)
        if length * bs <= hit.num_tokens or not loads:
            if first:
                self.offload.record_lookups((), not_found)
            return False
        if length * bs - hit.num_tokens < self.offload.config.min_load_tokens:
            if first:  # below the break-even length: recomputing is faster
                self.offload.record_short_hit([found[k] for k in keys], not_found)
            return False
        combined = PrefixHit(length * bs, blocks, hashes, self.kv.pool.epoch)
        if not self.kv.allocate_slots(request, 0, prefix_hit=combined):
            if first:  # it waits for room and is searched again
                self._looked_up.pop((request.request_id, request.num_tokens), None)
            return False
        self.offload.record_lookups([found[k] for k in keys], not_found if first else 0)
        tables = self.kv.get_block_ids(request.request_id)
        handle = self.offload.load(request.request_id, keys, [tables[g][i] for i, g in loads],
                                   block_tokens([g for _, g in loads], self._counted, bs))
        self._loads[request.request_id] = (request, handle, loads)
        return True

    def _first_lookup(self, request: Any) -> bool:
        """Whether this is the first search for ``request`` at its length: a request that
        waits for room is searched again every step, but counted once."""
        key = (request.request_id, request.num_tokens)
        if key in self._looked_up:
            return False
        self._looked_up[key] = None
        while len(self._looked_up) > MAX_REMEMBERED_LOOKUPS:
            self._looked_up.popitem(last=False)
        return True

    def poll(self) -> list[tuple[str, int | str]]:
        """Finish transfers; (request id, computed tokens) of each request whose load is
        done: its KV is valid up to there (a block that did not load intact shortens it).
        A request whose load failed in this code comes as (request id, the error); its
        blocks are freed."""
        done: list[tuple[str, int | str]] = []
        for handle in self.offload.poll():
            load = self._loads.pop(handle.request_id, None)
            if load is None:  # cancelled meanwhile
                self._let_go(handle)
                continue
            request, _, loads = load
            rid = request.request_id
            try:
                if handle.num_loaded < len(loads) and self._retry_after_failure(
                        request, loads, handle.num_loaded,
                        handle.error or "block no longer in a tier"):
                    continue  # a shorter load started
                done.append((rid, self.kv.num_computed_tokens(rid)))
            except Exception as exc:  # noqa: BLE001 - this request's alone
                log.exception("offload: finishing the load of request %s failed", rid)
                if not self.cancel(rid):  # waits for a retried load before freeing its blocks
                    self.kv.free(rid)
                done.append((rid, f"{type(exc).__name__}: {exc}"))
        return done

    def _retry_after_failure(self, request: Any, loads: list[Position], num_loaded: int,
                             error: str) -> bool:
        """``loads[num_loaded:]`` did not load (a failed block is dropped from its tier).
        The blocks that did are made findable by hash, the request's blocks are freed, and
        its hit is looked up again, in the pool and then the tiers: the longest length
        still valid for every group. True if a new load started."""
        rid = request.request_id
        tables = self.kv.get_block_ids(rid)
        hashes = self.kv.request_block_hashes(request, len(tables[0]))
        for i, g in loads[:num_loaded]:
            self.kv.pool.cache_table_blocks(g, tables[g], hashes, i, i + 1)
        self.kv.free(rid)
        hit = self.kv.get_computed_blocks(request)
        reloading = self.start_load(request, hit)
        if not reloading and hit.num_tokens:
            # NoCapacity (no room to adopt it now) leaves it to compute from the start
            self.kv.allocate_slots(request, 0, prefix_hit=hit)
        log.warning("offload: request %s: %s; %s", rid, error,
                    "loading a shorter hit" if reloading else
                    f"recomputing from token {self.kv.num_computed_tokens(rid)}")
        return reloading

    def wait(self, timeout: float) -> bool:
        """Block until the oldest load in flight is done (or, with none, the stores that hold
        blocks), up to ``timeout`` s; True if it is, False at once with nothing in flight.
        For an engine with nothing else to run, instead of spinning on ``poll``."""
        for _, handle, _ in self._loads.values():
            return handle.done.wait(timeout)
        return self.holds_blocks and self.offload.engine.wait_idle(timeout)

    @property
    def holds_blocks(self) -> bool:
        """Whether stores hold pool blocks until a ``poll`` sees them copied: an idle
        engine still has that step to take (elastic memory cannot give their pages back
        before)."""
        return self.offload.held_blocks > 0 or bool(self._abandoned)

    def cancel(self, request_id: str) -> bool:
        """Drop the load of a request (e.g. aborted) and free its blocks, without waiting:
        the blocks a load still in flight writes into are held (neither free nor
        evictable) until a later ``poll`` sees it done. False if no load of
        ``request_id`` is in flight."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return False
        handle = load[1]
        if not handle.done.is_set():
            self.kv.hold(handle.block_ids)
            self._abandoned.add(handle)
        self.kv.free(request_id)
        return True

    def _let_go(self, handle: LoadHandle) -> None:
        """A cancelled request's load is done: its blocks may be reused."""
        if handle in self._abandoned:
            self._abandoned.discard(handle)
            self.kv.release(handle.block_ids)

    def stats(self) -> dict[str, Any]:
        """``TierStats`` of each tier by name ("cpu", "disk")."""
        return self.offload.stats()

    def shutdown(self, flush: bool = False) -> None:
        """Cancel loads in flight and stop the tiers (finishing queued stores when ``flush``)."""
        for request_id in list(self._loads):
            self.cancel(request_id)
        self.offload.shutdown(flush=flush)  # ends every load (one stuck in a read is left)
        for handle in [h for h in self._abandoned if h.done.is_set()]:
            self._let_go(handle)
