"""KV block geometry of a rank: the rules an engine sizes its KV cache by.

``Geometry`` is what the planner asks of an engine: the bytes one block costs on a stage,
the blocks one request holds, what the engine's start-up check needs, and the KV cache
size and concurrency it reports. ``KVGeometry`` is kvmem's own engine: layers are grouped
by ``kvmem.spec.state_groups.engine_kv_groups`` (the attention groups of
``spec.kv_groups()``, then a linear-attention hybrid's state groups); the layer in slot j
of every group shares one slot tensor ``[num_blocks, 2, block_size, kv_heads_on_rank,
head_dim]`` (see ``kvmem.memory.storage``). One block id therefore costs a page in every
slot tensor of the rank, and block ids are shared by all groups (the scheduler's one block
pool). A linear layer's state is one page of its slot tensor: the block size is raised
until a page holds one, and nothing is kept apart from the blocks. vLLM's rules, per
release, are ``kvmem.plan.vllm_rules.VllmGeometry``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from kvmem.spec import AttentionKind, KVGroup, LayerKV, ModelSpec
from kvmem.spec.state_groups import (
    engine_kv_groups,
    engine_layer_slots,
    state_block_size,
    state_blocks_per_request,
)


@dataclass(frozen=True)
class StageKV:
    num_slots: int
    slot_page_bytes: int
    kv_bytes_per_token: int
    kv_heads_on_rank: int
    block_bytes: int | None = None  # when a block is not num_slots equal pages

    @property
    def bytes_per_block(self) -> int:
        if self.block_bytes is not None:
            return self.block_bytes
        return self.num_slots * self.slot_page_bytes


class Geometry(ABC):
    """An engine's KV cache rules for one model and engine config."""

    name: str
    block_size: int
    notes: list[str]

    def __init__(self, spec: ModelSpec, tp: int, kv_dtype_bytes: int, state_dtype_bytes: int,
                 block_size: int, max_num_batched_tokens: int) -> None:
        self.spec = spec
        self.tp = tp
        self.kv_dtype_bytes = kv_dtype_bytes
        self.state_dtype_bytes = state_dtype_bytes
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.notes = []

    @cached_property
    def layers(self) -> tuple[LayerKV, ...]:
        """The target's layers, then a speculative draft's (on the last stage)."""
        return self.spec.kv_layers

    def with_draft(self, layers: Sequence[int]) -> Sequence[int]:
        """A stage's layers, and the draft's when it is the last stage (vLLM builds the
        drafter on the last pipeline rank)."""
        drafts = range(self.spec.num_layers, len(self.layers))
        if drafts and layers and layers[-1] == self.spec.num_layers - 1:
            return [*layers, *drafts]
        return layers

    @cached_property
    def layer_bytes_per_token(self) -> list[int]:
        return [lay.bytes_per_token(self.tp, self.kv_dtype_bytes) for lay in self.layers]

    def _stage_kv(self, layers: Sequence[int], num_slots: int, page: int,
                  block_bytes: int | None = None) -> StageKV:
        paged = [i for i in layers if self.layers[i].has_own_cache]
        return StageKV(
            num_slots=num_slots, slot_page_bytes=page,
            kv_bytes_per_token=sum(self.layer_bytes_per_token[i] for i in layers),
            kv_heads_on_rank=max((self.layers[i].kv_heads_on_rank(self.tp)
                                  for i in paged), default=0),
            block_bytes=block_bytes)

    @property
    @abstractmethod
    def num_groups(self) -> int:
        """KV groups of the engine (each request has one block table per group)."""

    @abstractmethod
    def stage(self, layers: Sequence[int]) -> StageKV:
        """Block geometry of a pipeline stage holding ``layers``."""

    def grow(self, start: int, limit: int) -> Iterator[tuple[int, StageKV]]:
        """(end, geometry of layers start..end-1) for end = start+1 .. limit."""
        for end in range(start + 1, limit + 1):
            yield end, self.stage(range(start, end))

    @abstractmethod
    def blocks_per_request(self, seq_len: int, layers: Sequence[int] | None = None) -> int:
        """Blocks one request of seq_len tokens is charged, over all KV groups (of the
        stage holding ``layers`` where groups are per stage)."""

    @abstractmethod
    def check_need(self, layers: Sequence[int], kv: StageKV, seq_len: int) -> int:
        """KV bytes the engine's start-up check says one request of seq_len needs on the
        stage holding ``layers``."""

    def held_back(self, kv: StageKV) -> int:
        """KV bytes the engine holds back from a rank's budget before that check (the
        null block, which pads block tables)."""
        return kv.bytes_per_block

    def need_bytes(self, layers: Sequence[int], kv: StageKV, seq_len: int) -> int:
        return self.check_need(layers, kv, seq_len) + self.held_back(kv)

    def longest_fitting(self, layers: Sequence[int], kv: StageKV, kv_bytes: int,
                        limit: int) -> int:
        """Largest seq_len <= limit whose need fits in kv_bytes (0 if none)."""
        def fits(n: int) -> bool:
            return self.need_bytes(layers, kv, n) <= kv_bytes

        if fits(limit):
            return limit
        lo, hi = 0, limit  # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    @property
    def num_state_groups(self) -> int:
        """Groups whose blocks hold linear-attention states, not tokens (kvmem's engine)."""
        return 0

    def tokens(self, num_blocks: int) -> int:
        """Token capacity of num_blocks blocks (hybrid models split blocks across groups;
        a state group holds one or two blocks a request, whatever its length)."""
        return num_blocks * self.block_size // max(1, self.num_groups - self.num_state_groups)

    def kv_cache_size(self, num_blocks: int, seq_len: int,
                      layers: Sequence[int] | None = None) -> tuple[int, float]:
        """(KV cache size in tokens, maximum concurrency) as the engine reports them."""
        per_request = self.blocks_per_request(seq_len, layers)
        return self.tokens(num_blocks), num_blocks / per_request if per_request else 0.0


class KVGeometry(Geometry):
    """kvmem's engine: per-stage block sizes and per-request demand (module doc).

    ``prefix_caching``: whether state groups keep checkpoints (``kvmem.cache``'s
    ``StateManager``): a running request then holds at most two blocks of each state group
    (its state and the block it is carried into), else one."""

    name = "kvmem"

    def __init__(self, spec: ModelSpec, tp: int, kv_dtype_bytes: int, state_dtype_bytes: int,
                 block_size: int, max_num_batched_tokens: int, *,
                 prefix_caching: bool = True) -> None:
        super().__init__(spec, tp, kv_dtype_bytes, state_dtype_bytes, block_size,
                         max_num_batched_tokens)
        self.prefix_caching = prefix_caching
        self.block_size = state_block_size(spec, block_size, tp)
        if self.block_size != block_size:
            self.notes.append(f"kvmem's engine raises the block size to {self.block_size} "
                              "tokens so that a page holds one linear-attention state")

    @cached_property
    def groups(self) -> list[KVGroup]:
        return engine_kv_groups(self.spec)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_state_groups(self) -> int:
        return sum(g.kind is AttentionKind.LINEAR for g in self.groups)

    @cached_property
    def slots(self) -> dict[int, int]:
        return engine_layer_slots(self.spec)

    @cached_property
    def attention_layer(self) -> LayerKV | None:
        """The attention layer whose page shape every slot tensor has (a state-group page
        is the same page)."""
        return next((lay for lay in self.spec.layers if lay.kind.uses_blocks), None)

    @cached_property
    def page_bytes_per_token(self) -> list[int]:
        """Each layer's slot-tensor bytes per block token (0: no slot tensor)."""
        state_page = (self.attention_layer.bytes_per_token(self.tp, self.kv_dtype_bytes)
                      if self.attention_layer is not None else 0)
        return [(state_page if lay.kind is AttentionKind.LINEAR else per_token)
                if i in self.slots else 0
                for i, (lay, per_token) in enumerate(zip(self.layers, self.layer_bytes_per_token,
                                                         strict=True))]

    def stage(self, layers: Sequence[int]) -> StageKV:
        paged = [i for i in layers if i in self.slots]
        page = self.block_size * max((self.page_bytes_per_token[i] for i in paged), default=0)
        kv = self._stage_kv(layers, len({self.slots[i] for i in paged}), page)
        if paged and not kv.kv_heads_on_rank:  # linear layers only: the attention's pages
            kv = replace(kv, kv_heads_on_rank=self.attention_layer.kv_heads_on_rank(self.tp))
        return kv

    def grow(self, start: int, limit: int) -> Iterator[tuple[int, StageKV]]:
        # one layer at a time, updating the block geometry incrementally
        slots: set[int] = set()
        page = 0
        for i in range(start, limit):
            if i in self.slots:
                slots.add(self.slots[i])
                page = max(page, self.block_size * self.page_bytes_per_token[i])
            yield i + 1, StageKV(len(slots), page, 0, 0)

    def state_blocks_per_request(self, seq_len: int) -> int:
        """Blocks one request holds in a state group (``KVCacheManager.can_fit``)."""
        return state_blocks_per_request(seq_len, self.block_size,
                                        prefix_caching=self.prefix_caching)

    def blocks_per_request(self, seq_len: int, layers: Sequence[int] | None = None) -> int:
        return sum(self.state_blocks_per_request(seq_len) if g.kind is AttentionKind.LINEAR
                   else g.blocks_per_request(seq_len, self.block_size,
                                             self.max_num_batched_tokens)
                   for g in self.groups)

    def check_need(self, layers: Sequence[int], kv: StageKV, seq_len: int) -> int:
        return self.blocks_per_request(seq_len) * kv.bytes_per_block
