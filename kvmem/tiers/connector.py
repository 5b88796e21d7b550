"""``OffloadConnector``: the tiers in the scheduler's terms (requests and block tables).

It sits between a ``kvmem.cache.KVCacheManager`` and an ``OffloadManager`` and needs only
duck-typed requests (``request_id``, ``all_token_ids``, ``num_tokens``,
``num_computed_tokens``). The scheduler calls it at four points:

- ``offer(request)`` just before ``kv_cache_manager.free(request)`` (finish, preempt,
  abort): the request's cached blocks are held and copied to the tiers;
- ``start_load(request, hit)`` when admitting a waiting request, after the device pool's
  prefix hit: if the tiers hold the next blocks, blocks for them are allocated (all or
  nothing), the load starts, and the request is parked here (True is returned);
- ``poll()`` at the start of every step: finishes transfers and returns parked requests
  whose load is done, with ``num_computed_tokens`` set past what loaded correctly;
- ``cancel(request_id)`` for a parked request that is aborted.

Loaded blocks are allocated as lookahead slots, so they are not findable by hash until
the load has succeeded: no other request can read a block whose bytes are still on their
way, and blocks after a failed one are simply computed. The pool's ``evict_listener`` is
pointed at ``OffloadManager.on_evict``, so cached blocks reused for new data are kept too.

Loads need every KV group to be full attention (a sliding-window group's hit is not a
plain prefix); with other groups, blocks are still stored but never loaded.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmem.spec.layout import AttentionKind
from kvmem.tiers.manager import OffloadManager
from kvmem.tiers.transfer import LoadHandle

log = logging.getLogger("kvmem.tiers")


class OffloadConnector:
    def __init__(self, offload: OffloadManager, kv_cache_manager: Any) -> None:
        self.offload = offload
        self.kv = kv_cache_manager
        self.block_size: int = kv_cache_manager.block_size
        self.num_groups = len(kv_cache_manager.groups)
        self.loads_enabled = all(g.kind is AttentionKind.FULL for g in kv_cache_manager.groups)
        self._loading: dict[str, tuple[Any, LoadHandle]] = {}
        kv_cache_manager.pool.evict_listener = self._on_evict

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        self.offload.on_evict(block_id, (self.kv.pool.block_group[block_id], block_hash))

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
    def start_load(self, request: Any, hit: Any) -> bool:
        """Continue ``hit`` (a ``PrefixHit``) from the tiers; True if the request now waits
        here for its load (its blocks are allocated). False: admit it as usual."""
        if not self.loads_enabled or request.request_id in self._loading:
            return False
        bs, groups = self.block_size, self.num_groups
        start = hit.num_tokens // bs
        end = (request.num_tokens - 1) // bs  # always leave a prompt token to compute
        if end <= start:
            return False
        hashes = self.kv.request_block_hashes(request, end)
        keys = [(g, h) for h in hashes[start:end] for g in range(groups)]
        found = self.offload.lookup(keys) // groups
        if not found:
            return False
        if not self.kv.allocate_slots(request, 0, prefix_hit=hit,
                                      num_lookahead_tokens=found * bs):
            return False
        tables = self.kv.get_block_ids(request.request_id)
        block_ids = [tables[g][start + i] for i in range(found) for g in range(groups)]
        handle = self.offload.load(request.request_id, keys[:found * groups], block_ids)
        request.num_computed_tokens = hit.num_tokens
        self._loading[request.request_id] = (request, handle)
        return True

    def poll(self) -> list[Any]:
        """Finish transfers; return parked requests whose load is done, ready to run."""
        ready = []
        for handle in self.offload.poll():
            parked = self._loading.pop(handle.request_id, None)
            if parked is None:  # cancelled meanwhile
                continue
            request = parked[0]
            loaded = handle.num_loaded // self.num_groups
            if handle.error:
                log.warning("offload: request %s: %s; recomputing from block %d",
                            request.request_id, handle.error, loaded)
            if loaded:
                # The blocks were allocated with the load: this only advances and caches.
                done = self.kv.allocate_slots(request, loaded * self.block_size)
                assert done, "loaded blocks were allocated before the load"
            request.num_computed_tokens = self.kv.num_computed_tokens(request.request_id)
            ready.append(request)
        return ready

    def wait(self, timeout: float) -> bool:
        """Block until the oldest parked load is done (or ``timeout`` s); True if it is.
        For an engine with nothing else to run, instead of spinning on ``poll``."""
        for _, handle in self._loading.values():
            return handle.done.wait(timeout)
        return False

    def cancel(self, request_id: str) -> Any | None:
        """Forget a parked request (e.g. aborted); waits for its load, frees its blocks."""
        parked = self._loading.pop(request_id, None)
        if parked is None:
            return None
        parked[1].done.wait()
        self.kv.free(request_id)
        return parked[0]

    def stats(self) -> dict[str, Any]:
        """``TierStats`` of each tier by name ("cpu", "disk")."""
        return self.offload.stats()

    @property
    def loading(self) -> list[Any]:
        return [request for request, _ in self._loading.values()]

    def shutdown(self, flush: bool = False) -> None:
        """Cancel parked requests and stop the tiers (finishing queued stores when ``flush``)."""
        for request_id in list(self._loading):
            self.cancel(request_id)
        self.offload.shutdown(flush=flush)
