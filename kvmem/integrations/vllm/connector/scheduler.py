"""``KvmemConnector``'s scheduler side: prefix lookups past vLLM's cache, loads and stores.

It runs in vLLM's scheduler process and never touches KV bytes. What the tiers hold it
knows from the workers' ``TierReport``s: a block is loadable when every rank reported
it held (each rank keeps its own share of the KV in its own tiers). Blocks are found by
kvmem's chained prefix hashes over the request's token ids (and its adapter name and
cache salt), so a hit is the same in any process and after a restart. A stored block is
named by its KV cache group and hash: a hybrid model's groups (full attention beside
sliding-window or chunked local layers) are stored and loaded each by its own rules.

A block no rank reported is still loadable when every rank's disk namespace has its file:
another instance of the model sharing the directory wrote it (one ``lstat`` per rank; the
worker indexes the file when it loads it, and a file gone meanwhile is recomputed).

- ``get_num_new_matched_tokens``: from vLLM's own (block-aligned) hit, the longest run of
  following blocks that every group can be restored to, by vLLM's hybrid rules (a full
  group needs every block of the run; a sliding-window group only the blocks of its window
  before the run's end, the others being vLLM's null block), never the block of the last
  prompt token. ``None`` until every rank has sent its first report, so a restarted
  server's first request already sees the disk tier.
- ``update_state_after_alloc``: the blocks vLLM allocated for that hit in each group (not
  its null blocks) get a load in this step's metadata; a worker loads them before the
  forward, and any block that did not load intact is reported to vLLM as invalid and
  recomputed.
- ``request_finished_all_groups``: the request's full blocks in every group (those vLLM
  still holds: a sliding window's last blocks) that not every rank holds yet get a store;
  vLLM keeps them allocated (``True``: freed later) until the workers report the request
  finished sending, so no new request can overwrite them while they are copied.

For the tiers' figures each step's metadata also says how many blocks its lookups found in
no tier (misses in every tier; the workers count the hits as they load) and how many
tokens its forward computes when it computes prompt tokens (the workers time it: the
prefill rate). With vLLM's KV events on, ``events`` learns vLLM's description of every
block stored or loaded and turns the workers' tier changes into events (``take_events``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.cache.hashing import BlockHash, encode_extra_keys, extend_block_hashes
from kvmem.cache.results import NULL_BLOCK_ID as NULL_BLOCK
from kvmem.integrations.vllm.connector.layout import GroupRule, block_ids_per_group
from kvmem.integrations.vllm.connector.meta import (
    BlockTransfer,
    KvmemConnectorMetadata,
    TierReport,
)
from kvmem.tiers.blocks import key_name
from kvmem.tiers.disk_store import on_disk
from kvmem.tiers.stats import block_tokens, prefill_step_tokens

if TYPE_CHECKING:
    from kvmem.integrations.vllm.connector.events import TierEvents


@dataclass
class _Match:
    start: int  # first block past vLLM's own hit
    num_blocks: int  # found in the tiers
    end: int  # blocks looked up: start .. end - 1
    recomputed: bool = False  # found, but fewer tokens than min_load_tokens: not loaded


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
    def __init__(self, rules: list[GroupRule], block_size: int, num_ranks: int,
                 events: TierEvents | None = None, *, min_load_tokens: int = 0) -> None:
        """``min_load_tokens``: a tier hit sparing fewer tokens is recomputed."""
        self.rules = rules
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.events = events
        self.min_load_tokens = min_load_tokens
        # the groups whose loaded blocks count as hit tokens: those holding every position
        full = [g for g, rule in enumerate(rules) if rule.kind == "full"]
        self._counted = full or list(range(len(rules)))
        self._not_found = 0  # blocks this step's lookups found in no tier
        self._short_hits: list[tuple[int, bytes]] = []  # found, recomputed (min_load_tokens)
        self._holders: Counter[str] = Counter()  # block name -> ranks holding it
        self._reported: set[int] = set()
        self._hashes: dict[str, list[BlockHash]] = {}
        self._matches: dict[str, _Match] = {}
        self._loads: list[BlockTransfer] = []
        self._stores: list[BlockTransfer] = []
        self._held: dict[str, list[int]] = {}  # request -> blocks vLLM keeps for its store
        self._disk_roots: dict[int, Path] = {}  # rank -> its disk tier's namespace

    # -- lookups --------------------------------------------------------------------------
    def _block_hashes(self, request: Any, num_blocks: int, extra: bytes) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_block_hashes(hashes, request.all_token_ids, num_blocks,
                                   self.block_size, extra)[:num_blocks]

    def loadable(self, key: tuple[int, bytes]) -> bool:
        name = key_name(key)
        if self._holders[name] >= self.num_ranks:
            return True
        return len(self._disk_roots) == self.num_ranks and all(
            on_disk(root, name) for root in self._disk_roots.values())

    def _longest_restorable(self, hashes: list[BlockHash], start: int, end: int) -> int:
        """The largest ``stop <= end`` such that every group can have the blocks it keeps
        among ``start .. stop - 1`` loaded (the blocks before ``start`` are vLLM's own hit),
        else ``start``. A full group needs every block; a sliding-window or chunked group
        only those it keeps once ``stop`` blocks are computed. Each block is looked up at
        most once per group."""
        bs = self.block_size
        stop = end
        for group, rule in enumerate(self.rules):
            if rule.kind == "full":  # the run from start, to its first missing block
                index = start
                while index < stop and self.loadable((group, hashes[index])):
                    index += 1
                stop = index
        windowed = [(g, r) for g, r in enumerate(self.rules) if r.kind != "full"]
        known: dict[tuple[int, int], bool] = {}
        while stop > start:
            for group, rule in windowed:
                first = max(start, rule.first_kept_block(stop * bs, bs))
                missing = next((i for i in range(stop - 1, first - 1, -1)
                                if not self._holds(known, group, hashes, i)), None)
                if missing is not None:
                    stop = missing  # no run ending after a missing block can hold it
                    break
            else:
                return stop
        return start

    def _holds(self, known: dict[tuple[int, int], bool], group: int,
              hashes: list[BlockHash], index: int) -> bool:
        key = (group, index)
        if key not in known:
            known[key] = self.loadable((group, hashes[index]))
        return known[key]

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
        stop = self._longest_restorable(hashes, start, end)
        short = 0 < (stop - start) * bs < self.min_load_tokens
        self._matches[request.request_id] = _Match(start, stop - start, end, short)
        return (0 if short else (stop - start) * bs), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if match is None:
            return
        n = num_external_tokens // self.block_size
        assert n <= match.num_blocks, "vLLM allocated more external tokens than offered"
        if match.recomputed:  # its found blocks are neither loaded nor missed
            hashes = self._hashes[request.request_id]
            self._short_hits += [key for g in range(len(self.rules))
                                 for i in range(match.start, match.start + match.num_blocks)
                                 if self.loadable(key := (g, hashes[i]))]
            self._not_found += (match.end - match.start - match.num_blocks) * len(self.rules)
            return
        self._not_found += (match.end - match.start - n) * len(self.rules)
        if not n:
            return
        hashes = self._hashes[request.request_id]
        ids, keys = [], []
        for group, table in enumerate(block_ids_per_group(blocks.get_block_ids())):
            for index in range(match.start, match.start + n):
                if table[index] != NULL_BLOCK:  # a block this group keeps
                    ids.append(table[index])
                    keys.append((group, hashes[index]))
                    if self.events is not None:
                        self.events.describe(key_name(keys[-1]), request, index, group)
        self._loads.append(BlockTransfer(request.request_id, ids, keys, block_tokens(
            [g for g, _ in keys], self._counted, self.block_size)))

    # -- stores ---------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        """``block_ids``: one list per KV cache group (or group 0's list alone)."""
        self._matches.pop(request.request_id, None)
        extra = request_extra_keys(request)
        if extra is None:
            return False, None
        tables = block_ids_per_group(block_ids)
        num_full = min(max(map(len, tables)), request.num_computed_tokens // self.block_size)
        hashes = self._block_hashes(request, num_full, extra)
        del self._hashes[request.request_id]
        ids, keys = [], []
        for group, table in enumerate(tables):
            for index, (block_id, block_hash) in enumerate(zip(table, hashes, strict=False)):
                if index >= num_full:
                    break
                if block_id == NULL_BLOCK:
                    if self.rules[group].kind == "full":
                        break  # a full group's prefix stops here
                    continue  # outside a window: vLLM no longer keeps it
                if not self.loadable((group, block_hash)):
                    ids.append(block_id)
                    keys.append((group, block_hash))
                    if self.events is not None:
                        self.events.describe(key_name(keys[-1]), request, index, group)
        if not ids:
            return False, None
        self._stores.append(BlockTransfer(request.request_id, ids, keys))
        self._held[request.request_id] = [b for table in tables for b in table
                                          if b != NULL_BLOCK]
        return True, None

    # -- per step -------------------------------------------------------------------------
    def build_connector_meta(self, scheduled_tokens: Iterable[int] = ()
                             ) -> KvmemConnectorMetadata:
        """This step's message; ``scheduled_tokens``: the tokens it computes per request."""
        meta = KvmemConnectorMetadata(loads=self._loads, stores=self._stores,
                                      not_found_blocks=self._not_found,
                                      short_hit_keys=self._short_hits,
                                      prefill_tokens=prefill_step_tokens(scheduled_tokens))
        self._loads, self._stores, self._not_found, self._short_hits = [], [], 0, []
        return meta

    def update_connector_output(self, output: Any) -> None:
        for request_id in output.finished_sending or ():
            self._held.pop(request_id, None)
        report = output.kv_connector_worker_meta
        if isinstance(report, TierReport):
            for rank, (root, tier) in report.disk_tiers.items():
                self._disk_roots[rank] = Path(root)
                if self.events is not None and rank == 0 and tier:
                    self.events.disk_tier_id = tier
            for rank, events in report.changes.items():
                self._reported.add(rank)
                for name, held in events:
                    self._holders[name] += 1 if held else -1
                    if self._holders[name] <= 0:
                        del self._holders[name]
            if self.events is not None:
                self.events.changed(report.tier_changes)

    def take_events(self) -> list:
        """vLLM's KV events of the tiers since the last call (none without ``events``)."""
        return self.events.take() if self.events is not None else []

    def has_pending_block_frees(self) -> bool:
        """Blocks held for stores come back soon: a request short of blocks may wait for
        them instead of preempting another."""
        return bool(self._held)

    def held_block_ids(self) -> set[int]:
        """The blocks vLLM keeps allocated for stores still in flight (none of them may
        be handed to another request until the store is done)."""
        return {b for ids in self._held.values() for b in ids}
