"""KV events for kvmem's tiers in vLLM's event stream: a block stored to or evicted from
the CPU or disk tier, under vLLM's own block hash, with its medium.

vLLM publishes what the connector's ``take_events`` returns beside its own device-cache
events (``--kv-events-config``), so a KV-aware router subscribed to vLLM learns that a
prefix also sits in kvmem's tiers. The media are vLLM's names, as its own offloading
connector publishes them: the CPU tier is ``CPU``, the disk tier ``STORAGE``.

kvmem names a tier block by its own chained prefix hash; the events carry vLLM's hash of
the same block (the one vLLM's device-cache events carry), its parent's, its tokens and
extra keys, taken from vLLM's ``Request`` when the scheduler side plans the block's store
or a load of it (``describe``). A block counts as stored in a tier once every rank holds
its share there, and as removed when the first rank lets it go, as vLLM's connectors
count events common to all workers. A block a restarted server finds on disk is
announced once a request's load first describes it (its vLLM hash is not known before).

The disk tier may be shared by every instance of the model (one directory): its events
carry ``ownership="kvmem-disk:<id>"``, the id of the tier's namespace, the same in every
instance sharing it, so a router counts a block stored there once, not once per instance
that tells of it. The CPU tier is each instance's own and carries none.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
MAX_PENDING = 16384  # described blocks no tier has reported yet (stores may be skipped)


@dataclass(frozen=True)
class _Block:
    """What vLLM's events say of one block."""

    block_hash: Any  # vLLM's external form (bytes or int)
    parent_hash: Any
    token_ids: array
    lora_id: int | None
    lora_name: str | None
    extra_keys: list | None
    group: int


class TierEvents:
    """The scheduler side's view of each tier, block by block, turned into events."""

    def __init__(self, num_ranks: int, block_size: int, hash_block_size: int) -> None:
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self._ranks: Counter[tuple[str, str]] = Counter()  # (tier, name) -> ranks holding it
        self._held: Counter[str] = Counter()  # name -> (tier, rank) places holding it
        self._blocks: dict[str, _Block] = {}  # described, held somewhere
        self._pending: OrderedDict[str, _Block] = OrderedDict()  # described, not held yet
        self._announced: set[tuple[str, str]] = set()
        self._events: list[KVCacheEvent] = []
        self.disk_tier_id = ""  # the shared disk tier's id (rank 0's first report)

    def describe(self, name: str, request: Any, index: int, group: int) -> None:
        """Learn block ``index`` of ``request`` (KV cache group ``group``), kvmem's ``name``."""
        if name in self._blocks or name in self._pending:
            return
        hashes = request.block_hashes
        if self.hash_block_size != self.block_size:
            hashes = resolve_block_hashes(hashes, self.hash_block_size, self.block_size)
        if index >= len(hashes):
            return
        start, end = index * self.block_size, (index + 1) * self.block_size
        extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
        lora = request.lora_request
        block = _Block(
            maybe_convert_block_hash(hashes[index]),
            maybe_convert_block_hash(hashes[index - 1]) if index else None,
            array("l", request.all_token_ids[start:end]),
            lora.adapter_id if lora is not None else None,
            lora.name if lora is not None else None, to_event_extra_keys([extra]), group)
        if self._held[name]:
            self._blocks[name] = block
            for tier in MEDIA:
                if self._ranks[tier, name] == self.num_ranks:
                    self._announce(tier, name)
        else:
            self._pending[name] = block
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)

    def changed(self, tier_changes: dict[int, list[tuple[str, str, bool]]]) -> None:
        """Apply the ranks' tier changes (``TierReport.tier_changes``), in order."""
        for changes in tier_changes.values():
            for tier, name, present in changes:
                key = (tier, name)
                before = self._ranks[key]
                self._ranks[key] += 1 if present else -1
                self._held[name] += 1 if present else -1
                if present and name in self._pending:
                    self._blocks[name] = self._pending.pop(name)
                if present and before + 1 == self.num_ranks:
                    self._announce(tier, name)
                elif not present and key in self._announced:
                    self._announced.discard(key)
                    block = self._blocks[name]
                    self._events.append(BlockRemoved(block_hashes=[block.block_hash],
                                                     medium=MEDIA[tier], group_idx=block.group,
                                                     **self._owner(tier)))
                if self._ranks[key] <= 0:
                    del self._ranks[key]
                if self._held[name] <= 0:
                    del self._held[name]
                    self._blocks.pop(name, None)

    def _announce(self, tier: str, name: str) -> None:
        block = self._blocks.get(name)
        if block is None or (tier, name) in self._announced:
            return
        self._announced.add((tier, name))
        self._events.append(BlockStored(
            block_hashes=[block.block_hash], parent_block_hash=block.parent_hash,
            token_ids=block.token_ids.tolist(), block_size=self.block_size,
            lora_id=block.lora_id, medium=MEDIA[tier], lora_name=block.lora_name,
            extra_keys=block.extra_keys, group_idx=block.group, **self._owner(tier)))

    def _owner(self, tier: str) -> dict[str, str]:
        """The shared disk tier's name, where vLLM's events have the field for it."""
        if tier != "disk" or not self.disk_tier_id or \
                "ownership" not in BlockStored.__struct_fields__:
            return {}
        return {"ownership": f"kvmem-disk:{self.disk_tier_id}"}

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
