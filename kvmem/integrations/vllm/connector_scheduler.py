"""``KvmemConnector``'s scheduler side: prefix lookups past vLLM's cache, loads and stores.

It runs in vLLM's scheduler process and never touches KV bytes. What the tiers hold it
knows from the workers' ``TierReport``s: a block is loadable when every rank reported
it held (each rank keeps its own share of the KV in its own tiers). Blocks are found by
kvmem's chained prefix hashes over the request's token ids (and its adapter name and
cache salt), so a hit is the same in any process and after a restart.

- ``get_num_new_matched_tokens``: from vLLM's own (block-aligned) hit, the run of
  following blocks every rank holds, never the block of the last prompt token. ``None``
  until every rank has sent its first report, so a restarted server's first request
  already sees the disk tier.
- ``update_state_after_alloc``: the blocks vLLM allocated for that hit get a load in
  this step's metadata; a worker loads them before the forward, and any block that did
  not load intact is reported to vLLM as invalid and recomputed.
- ``request_finished``: the request's full blocks that not every rank holds yet get a
  store; vLLM keeps them allocated (``True``: freed later) until the workers report the
  request finished sending, so no new request can overwrite them while they are copied.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvmem.cache.hashing import BlockHash, encode_extra_keys, extend_block_hashes
from kvmem.integrations.vllm.connector_meta import (
    BlockTransfer,
    KvmemConnectorMetadata,
    TierReport,
)
from kvmem.tiers.blocks import key_name

GROUP = 0  # the only KV cache group: hybrid models run with vLLM's hybrid manager off


@dataclass
class _Match:
    start: int  # first block past vLLM's own hit
    num_blocks: int


def request_extra_keys(request: Any) -> bytes | None:
    """The extra hash keys of a vLLM request (adapter, cache salt); None for a request
    whose KV does not follow from its token ids alone (images, prompt embeddings)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) \
            is not None:
        return None
    lora = getattr(request, "lora_request", None)
    return encode_extra_keys(lora.lora_name if lora is not None else None,
                             getattr(request, "cache_salt", None))


class SchedulerSide:
    def __init__(self, block_size: int, num_ranks: int) -> None:
        self.block_size = block_size
        self.num_ranks = num_ranks
        self._holders: Counter[str] = Counter()  # block name -> ranks holding it
        self._reported: set[int] = set()
        self._hashes: dict[str, list[BlockHash]] = {}
        self._matches: dict[str, _Match] = {}
        self._loads: list[BlockTransfer] = []
        self._stores: list[BlockTransfer] = []
        self._storing: set[str] = set()  # requests whose blocks vLLM keeps for a store

    # -- lookups --------------------------------------------------------------------------
    def _block_hashes(self, request: Any, num_blocks: int, extra: bytes) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_block_hashes(hashes, request.all_token_ids, num_blocks,
                                   self.block_size, extra)[:num_blocks]

    def loadable(self, key: tuple[int, bytes]) -> bool:
        return self._holders[key_name(key)] >= self.num_ranks

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        extra = request_extra_keys(request)
        if extra is None:
            return 0, False
        if len(self._reported) < self.num_ranks:
            return None, False  # the workers have not said what their tiers hold yet
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # always compute the last prompt token
        if end <= start:
            return 0, False
        hashes = self._block_hashes(request, end, extra)
        n = 0
        while start + n < end and self.loadable((GROUP, hashes[start + n])):
            n += 1
        if not n:
            self._matches.pop(request.request_id, None)
            return 0, False
        self._matches[request.request_id] = _Match(start, n)
        return n * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if not num_external_tokens or match is None:
            return
        n = num_external_tokens // self.block_size
        assert n <= match.num_blocks, "vLLM allocated more external tokens than offered"
        block_ids = blocks.get_block_ids()[GROUP][match.start:match.start + n]
        hashes = self._hashes[request.request_id][match.start:match.start + n]
        self._loads.append(BlockTransfer(request.request_id, list(block_ids),
                                         [(GROUP, h) for h in hashes]))

    # -- stores ---------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self._matches.pop(request.request_id, None)
        extra = request_extra_keys(request)
        if extra is None:
            return False, None
        num_full = min(len(block_ids), request.num_computed_tokens // self.block_size)
        hashes = self._block_hashes(request, num_full, extra)
        del self._hashes[request.request_id]
        ids, keys = [], []
        for block_id, block_hash in zip(block_ids[:num_full], hashes, strict=True):
            if block_id == 0:  # vLLM's null block: the prefix stops here
                break
            if not self.loadable((GROUP, block_hash)):
                ids.append(block_id)
                keys.append((GROUP, block_hash))
        if not ids:
            return False, None
        self._stores.append(BlockTransfer(request.request_id, ids, keys))
        self._storing.add(request.request_id)
        return True, None

    # -- per step -------------------------------------------------------------------------
    def build_connector_meta(self) -> KvmemConnectorMetadata:
        meta = KvmemConnectorMetadata(loads=self._loads, stores=self._stores)
        self._loads, self._stores = [], []
        return meta

    def update_connector_output(self, output: Any) -> None:
        for request_id in output.finished_sending or ():
            self._storing.discard(request_id)
        report = output.kv_connector_worker_meta
        if isinstance(report, TierReport):
            for rank, events in report.changes.items():
                self._reported.add(rank)
                for name, held in events:
                    self._holders[name] += 1 if held else -1
                    if self._holders[name] <= 0:
                        del self._holders[name]

    def has_pending_block_frees(self) -> bool:
        """Blocks held for stores come back soon: a request short of blocks may wait for
        them instead of preempting another."""
        return bool(self._storing)
