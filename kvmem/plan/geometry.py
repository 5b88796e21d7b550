"""KV block geometry of a rank, exactly as the engine lays out its KV storage.

Layers are grouped by ``spec.kv_groups()``; the layer in slot j of every group shares one
slot tensor ``[num_blocks, 2, block_size, kv_heads_on_rank, head_dim]`` (see
``kvmem.memory.storage``). One block id therefore costs a page in every slot tensor of the
rank, and block ids are shared by all groups (the scheduler's one block pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvmem.spec import KVGroup, ModelSpec


@dataclass(frozen=True)
class StageKV:
    num_slots: int
    slot_page_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_request: int  # linear-attention layers
    kv_heads_on_rank: int

    @property
    def bytes_per_block(self) -> int:
        return self.num_slots * self.slot_page_bytes


class KVGeometry:
    """Per-stage block sizes and per-request block demand for one model and engine config."""

    def __init__(self, spec: ModelSpec, tp: int, kv_dtype_bytes: int, state_dtype_bytes: int,
                 block_size: int, max_num_batched_tokens: int) -> None:
        self.spec = spec
        self.tp = tp
        self.kv_dtype_bytes = kv_dtype_bytes
        self.state_dtype_bytes = state_dtype_bytes
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens

    @cached_property
    def groups(self) -> list[KVGroup]:
        return self.spec.kv_groups()

    @cached_property
    def slots(self) -> dict[int, int]:
        return self.spec.layer_slots()

    @cached_property
    def layer_bytes_per_token(self) -> list[int]:
        return [lay.bytes_per_token(self.tp, self.kv_dtype_bytes) for lay in self.spec.layers]

    @cached_property
    def layer_state_bytes(self) -> list[int]:
        return [lay.state_bytes(self.tp, self.state_dtype_bytes) for lay in self.spec.layers]

    def stage(self, layers: range | list[int]) -> StageKV:
        paged = [i for i in layers if i in self.slots]
        page = self.block_size * max((self.layer_bytes_per_token[i] for i in paged), default=0)
        heads = max((self.spec.layers[i].kv_heads_on_rank(self.tp) for i in paged), default=0)
        return StageKV(
            num_slots=len({self.slots[i] for i in paged}),
            slot_page_bytes=page,
            kv_bytes_per_token=sum(self.layer_bytes_per_token[i] for i in layers),
            state_bytes_per_request=sum(self.layer_state_bytes[i] for i in layers),
            kv_heads_on_rank=heads,
        )

    def blocks_per_request(self, seq_len: int) -> int:
        """Blocks one request of seq_len tokens holds, over all KV groups."""
        return sum(g.blocks_per_request(seq_len, self.block_size, self.max_num_batched_tokens)
                   for g in self.groups)

    def tokens(self, num_blocks: int) -> int:
        """Token capacity of num_blocks blocks (hybrid models split blocks across groups)."""
        return num_blocks * self.block_size // max(1, len(self.groups))

    def longest_fitting(self, num_blocks: int, limit: int) -> int:
        """Largest seq_len <= limit whose blocks fit in num_blocks (0 if none)."""
        if self.blocks_per_request(limit) <= num_blocks:
            return limit
        lo, hi = 0, limit  # blocks_per_request(lo) fits, (hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.blocks_per_request(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid
        return lo
