"""The messages between ``KvmemConnector``'s scheduler side and its workers.

Scheduler to workers, once per step (``KvmemConnectorMetadata``): the tier blocks to load
into newly allocated blocks before this step's forward, and the blocks of finished
requests to store (vLLM keeps them allocated until the workers name the request in
``finished_sending``).

Workers to scheduler, once per step (``TierReport``): which blocks became readable in a
rank's tiers and which left them, in order, so the scheduler answers prefix lookups from
its own view without asking the workers. A rank's first report (its disk tier's blocks
from earlier processes included) tells the scheduler the rank is up.

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


@dataclass
class KvmemConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)


@dataclass
class TierReport(KVConnectorWorkerMetadata):
    """Per rank, the index changes since its last report: (block name, now held)."""

    changes: dict[int, list[tuple[str, bool]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TierReport:
        assert isinstance(other, TierReport)
        merged = {rank: list(events) for rank, events in self.changes.items()}
        for rank, events in other.changes.items():
            merged.setdefault(rank, []).extend(events)
        return TierReport(merged)
