"""A model's KV layout: what each layer stores per token, and how layers form KV groups.

This is the vocabulary every other part of kvmem speaks. The sharding rules of
MISSION.md live here (``LayerKV.bytes_per_token``) so that the planner, the block
manager and the engine cannot disagree about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from math import ceil


class AttentionKind(str, Enum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    CHUNKED = "chunked_attention"
    MLA = "mla"
    LINEAR = "linear_attention"  # constant-size recurrent state per request (no blocks)

    @property
    def uses_blocks(self) -> bool:
        return self is not AttentionKind.LINEAR


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps per token (or per request, for linear attention)."""

    index: int
    kind: AttentionKind
    num_kv_heads: int = 1
    head_dim: int = 0
    window: int | None = None  # sliding window or attention chunk size, in tokens
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    state_elements: int = 0  # linear attention: state elements per request, all heads

    def kv_heads_on_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds; heads are replicated when tp exceeds them."""
        return max(1, self.num_kv_heads // tp)

    def elements_per_token(self, tp: int = 1) -> int:
        if self.kind is AttentionKind.MLA:
            return self.latent_dim  # the latent is not split across tensor-parallel ranks
        if self.kind is AttentionKind.LINEAR:
            return 0
        return 2 * self.kv_heads_on_rank(tp) * self.head_dim

    def bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        return self.elements_per_token(tp) * dtype_bytes

    def state_bytes(self, tp: int, dtype_bytes: int) -> int:
        """Per-request constant state (linear attention only)."""
        if self.kind is not AttentionKind.LINEAR:
            return 0
        return ceil(self.state_elements / tp) * dtype_bytes


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per request.

    Layers of one attention kind (and window) are split into groups of equal size; the
    layer at position ``slot`` of every group shares one KV tensor, so a block id owned
    by one group occupies that tensor's page for each of the group's layers.
    """

    group_id: int
    kind: AttentionKind
    window: int | None
    layers: tuple[int, ...]

    def max_tokens_needed(self, seq_len: int, max_num_batched_tokens: int) -> int:
        """Most tokens of one request this group keeps in blocks at once."""
        if self.kind is AttentionKind.SLIDING and self.window:
            return min(seq_len, self.window - 1 + max_num_batched_tokens)
        if self.kind is AttentionKind.CHUNKED and self.window:
            return min(seq_len, self.window + max_num_batched_tokens)
        return seq_len

    def blocks_per_request(self, seq_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        tokens = self.max_tokens_needed(seq_len, max_num_batched_tokens)
        blocks = ceil(tokens / block_size)
        if tokens < seq_len:  # a window straddles one more block boundary
            blocks += 1
        return min(blocks, ceil(seq_len / block_size))


@dataclass(frozen=True)
class MoE:
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    first_k_dense: int = 0  # leading layers with a dense MLP
    interleave_step: int = 1  # every n-th layer is MoE (Llama 4)


@dataclass(frozen=True)
class MLA:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything kvmem needs to know about a model to size its KV cache and weights."""

    name: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    max_position_embeddings: int | None
    layers: tuple[LayerKV, ...]
    moe: MoE | None = None
    mla: MLA | None = None
    total_params: int | None = None
    weight_bits: float | None = None  # quantised checkpoints: average bits per weight
    hf_id: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def attention_kinds(self) -> set[AttentionKind]:
        return {layer.kind for layer in self.layers}

    @property
    def is_hybrid(self) -> bool:
        return len({(lay.kind, lay.window) for lay in self.layers if lay.kind.uses_blocks}) > 1

    def kv_bytes_per_token(self, layers: range | list[int] | None = None, *, tp: int = 1,
                           dtype_bytes: int = 2) -> int:
        """KV bytes per token of context, on one tensor-parallel rank, over ``layers``."""
        idx = range(self.num_layers) if layers is None else layers
        return sum(self.layers[i].bytes_per_token(tp, dtype_bytes) for i in idx)

    def kv_groups(self) -> list[KVGroup]:
        return build_kv_groups(self.layers)

    def layer_slots(self) -> dict[int, int]:
        """Layer index -> slot (the shared KV tensor it uses)."""
        return {layer: slot for g in self.kv_groups() for slot, layer in enumerate(g.layers)}


def build_kv_groups(layers: tuple[LayerKV, ...] | list[LayerKV]) -> list[KVGroup]:
    """Split layers into KV groups of the smallest class's layer count; a class's last
    group holds the rest and may be shorter (Gemma 3 27B: sliding 10,10,10,10,10,2)."""
    classes: dict[tuple[AttentionKind, int | None], list[int]] = {}
    for layer in layers:
        if layer.kind.uses_blocks:
            classes.setdefault((layer.kind, layer.window), []).append(layer.index)
    if not classes:
        return []
    size = min(len(members) for members in classes.values())
    groups: list[KVGroup] = []
    for (kind, window), members in classes.items():
        for start in range(0, len(members), size):
            groups.append(KVGroup(len(groups), kind, window, tuple(members[start:start + size])))
    return groups
