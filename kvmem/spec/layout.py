"""A model's KV layout: what each layer stores per token, and how layers form KV groups.

This is the vocabulary every other part of kvmem speaks. The sharding rules of
MISSION.md live here (``LayerKV.bytes_per_token``) so that the planner, the block
manager and the engine cannot disagree about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from math import ceil, prod

from kvmem.errors import ConfigError

# vLLM's fp8_ds_mla page per token of DeepSeek's latent (kv_lora_rank 512, rope 64): 512 fp8
# values, 4 float32 scales and the 64 rope values kept in bf16 (``MLAAttention.get_kv_cache_
# spec``). Sparse MLA (FlashMLA sparse) stores any 8-bit KV in this layout.
FP8_DS_MLA_BYTES = 656


class StateKind(str, Enum):
    """The recurrent state a linear-attention layer keeps per request (vLLM's names)."""

    GATED_DELTA_NET = "gated_delta_net"  # Qwen3-Next, Qwen3.5
    MAMBA2 = "mamba2"  # Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1
    SHORT_CONV = "short_conv"  # LFM2
    KDA = "kda"  # Kimi Linear
    LIGHTNING = "linear_attention"  # MiniMax lightning attention


def _divide(n: int, tp: int) -> int:
    if n % tp:
        raise ConfigError(f"a linear-attention state dimension of {n} cannot be split "
                          f"across tensor parallel size {tp}")
    return n // tp


@dataclass(frozen=True)
class LinearState:
    """A linear-attention layer's per-request state as vLLM's ``MambaStateShapeCalculator``
    shapes it: a causal-conv state (``conv_len`` rows of ``conv_channels``, one more row
    per speculative token) and a temporal (SSM) state ``temporal`` = (heads, a, b), both
    split across tensor-parallel ranks. Mamba2 repeats its B/C groups on each rank when tp
    does not divide ``n_groups``."""

    kind: StateKind
    conv_channels: int
    conv_len: int  # conv kernel - 1 (0: no conv state)
    temporal: tuple[int, int, int] | None = None
    n_groups: int = 0  # Mamba2 only
    state_size: int = 0  # Mamba2 only
    ssm_dtype: str | None = None  # the SSM state's dtype when left "auto" (None: the conv's)
    bounded_gate: bool = False  # KDA only: gate_lower_bound set (FlashKDA's prefill)

    def shapes(self, tp: int, num_spec: int = 0) -> list[tuple[tuple[int, ...], bool]]:
        """Each state tensor's shape on one rank, and whether it is the SSM state."""
        out: list[tuple[tuple[int, ...], bool]] = []
        if self.conv_len:
            channels = self.conv_channels
            if self.n_groups % tp:
                channels += 2 * (tp - self.n_groups) * self.state_size
            out.append(((self.conv_len + num_spec, _divide(channels, tp)), False))
        if self.temporal:
            heads, a, b = self.temporal
            out.append(((_divide(heads, tp), a, b), True))
        return out

    def bytes(self, tp: int, conv_bytes: int, ssm_bytes: int, num_spec: int = 0) -> int:
        return sum(prod(shape) * (ssm_bytes if ssm else conv_bytes)
                   for shape, ssm in self.shapes(tp, num_spec))


class AttentionKind(str, Enum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    CHUNKED = "chunked_attention"
    MLA = "mla"
    LINEAR = "linear_attention"  # constant-size recurrent state per request (no blocks)
    NONE = "none"  # no attention and no state (Nemotron-H's MLP and MoE layers)

    @property
    def uses_blocks(self) -> bool:
        return self not in (AttentionKind.LINEAR, AttentionKind.NONE)


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps per token (or per request, for linear attention)."""

    index: int
    kind: AttentionKind
    num_kv_heads: int = 1
    head_dim: int = 0
    window: int | None = None  # sliding window or attention chunk size, in tokens
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    state: LinearState | None = None  # linear attention: the per-request state
    kv_source: int | None = None  # KV shared across layers: the layer whose cache it reads
    sparse: bool = False  # sparse MLA (DeepSeek V3.2): 8-bit KV is stored as fp8_ds_mla
    index_bytes: int = 0  # sparse MLA: the indexer's key cache, bytes per token (any dtype)

    @property
    def has_own_cache(self) -> bool:
        """Whether the layer keeps KV blocks of its own (a layer reading another's
        cache, like Gemma 3n's last layers, keeps none and joins no group)."""
        return self.kind.uses_blocks and self.kv_source is None

    def kv_heads_on_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds; heads are replicated when tp exceeds them."""
        return max(1, self.num_kv_heads // tp)

    def elements_per_token(self, tp: int = 1) -> int:
        if self.kind is AttentionKind.MLA:
            return self.latent_dim  # the latent is not split across tensor-parallel ranks
        if not self.kind.uses_blocks:
            return 0
        return 2 * self.kv_heads_on_rank(tp) * self.head_dim

    def bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        if self.kv_source is not None:
            return 0
        if self.kind is AttentionKind.MLA and self.sparse:
            latent = FP8_DS_MLA_BYTES if dtype_bytes == 1 else self.latent_dim * dtype_bytes
            return latent + self.index_bytes
        return self.elements_per_token(tp) * dtype_bytes

    def state_bytes(self, tp: int, dtype_bytes: int, ssm_bytes: int | None = None) -> int:
        """Per-request constant state (linear attention only), its SSM part at
        ``ssm_bytes`` (default ``dtype_bytes``)."""
        if self.kind is not AttentionKind.LINEAR or self.state is None:
            return 0
        return self.state.bytes(tp, dtype_bytes, dtype_bytes if ssm_bytes is None
                                else ssm_bytes)


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
class Speculative:
    """Speculative decoding as vLLM's ``--speculative-config`` sets it up: the draft's own
    KV layers (indexed after the target's) and the tokens proposed per step."""

    method: str  # "mtp", "eagle", "eagle3", "draft_model", "ngram", ...
    num_speculative_tokens: int
    layers: tuple[LayerKV, ...] = ()
    num_mtp_layers: int = 0  # the target's num_nextn_predict_layers (MTP)


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
    speculative: Speculative | None = None
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

    @property
    def kv_layers(self) -> tuple[LayerKV, ...]:
        """Every layer with KV: the target's, then a speculative draft's (indices go on)."""
        return self.layers + (self.speculative.layers if self.speculative else ())

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
        if layer.has_own_cache:
            classes.setdefault((layer.kind, layer.window), []).append(layer.index)
    if not classes:
        return []
    size = min(len(members) for members in classes.values())
    groups: list[KVGroup] = []
    for (kind, window), members in classes.items():
        for start in range(0, len(members), size):
            groups.append(KVGroup(len(groups), kind, window, tuple(members[start:start + size])))
    return groups
