"""The messages between ``KvmemConnector``'s scheduler side and its workers.

Scheduler to workers, once per step (``KvmemConnectorMetadata``): the tier blocks to load
into newly allocated blocks before this step's forward, and the blocks of finished
requests to store (vLLM keeps them allocated until the workers name the request in
``finished_sending``); for the tiers' figures, the blocks this step's lookups found in no
tier and the tokens its forward computes when it computes prompt tokens.

Workers to scheduler, once per step (``TierReport``): which blocks became readable in a
rank's tiers and which left them, in order, so the scheduler answers prefix lookups from
its own view without asking the workers. A rank's first report (its disk tier's blocks
from earlier processes included) tells the scheduler the rank is up. With vLLM's KV events
on, the same changes tier by tier, for the events of each medium (``events``). A rank
with a disk tier names, in its first report, its namespace and the namespace's id
(``disk_tiers``): the scheduler looks there by name for blocks other instances sharing
the directory wrote, and names the shared tier in its events.

A block is named ``kvmem.tiers.blocks.key_name((group, hash))``: its KV cache group and
kvmem's chained prefix hash (``kvmem.cache.hashing``), stable across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

BlockKey = tuple[int, bytes]  # (KV cache group, prefix hash)


@dataclass
class BlockTransfer:
    """Blocks of one request, moving between vLLM's KV cache and kvmem's tiers."""

    request_id: str
    block_ids: list[int]
    keys: list[BlockKey]
    block_tokens: list[float] = field(default_factory=list)  # loads: tokens each restores


@dataclass
class KvmemConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)
    not_found_blocks: int = 0  # looked up past vLLM's hit, held by no tier: misses
    # found in the tiers but recomputed, the hit being under min_load_tokens
    short_hit_keys: list[BlockKey] = field(default_factory=list)
    prefill_tokens: int = 0  # tokens the forward computes, if it computes prompt tokens


@dataclass
class TierReport(KVConnectorWorkerMetadata):
    """Per rank, the index changes since its last report: (block name, now held by some
    tier of the rank); with KV events on, also each tier's: (tier, block name, now held)."""

    changes: dict[int, list[tuple[str, bool]]] = field(default_factory=dict)
    tier_changes: dict[int, list[tuple[str, str, bool]]] = field(default_factory=dict)
    disk_tiers: dict[int, tuple[str, str]] = field(default_factory=dict)  # (namespace, id)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TierReport:
        assert isinstance(other, TierReport)
        return TierReport(_merged(self.changes, other.changes),
                          _merged(self.tier_changes, other.tier_changes),
                          {**self.disk_tiers, **other.disk_tiers})


def _merged(mine: dict[int, list], theirs: dict[int, list]) -> dict[int, list]:
    merged = {rank: list(events) for rank, events in mine.items()}
    for rank, events in theirs.items():
        merged.setdefault(rank, []).extend(events)
    return merged
