"""The KV groups of a linear-attention hybrid in kvmem's engine: its attention groups
(``ModelSpec.kv_groups``) and, after them, state groups of its linear-attention layers.

vLLM's rule (``_get_kv_cache_groups_uniform_page_size``): every kind of layer is split
into groups of the smallest kind's layer count, and the layer at position ``slot`` of
every group shares one tensor of pages. A request holds blocks of each state group like
those of an attention group (``kvmem.cache``'s ``StateManager``); the block's page in a
linear layer's slot tensor holds that layer's state. So that a page holds a state, the
block size is raised until the attention page is at least one state (vLLM's
``_align_hybrid_block_size``), in multiples of 16 tokens.
"""

from __future__ import annotations

from math import ceil, prod

from kvmem.errors import ConfigError
from kvmem.spec import AttentionKind, ModelSpec
from kvmem.spec.layout import KVGroup

BLOCK_MULTIPLE = 16


def linear_layers(spec: ModelSpec) -> list[int]:
    return [layer.index for layer in spec.layers if layer.kind is AttentionKind.LINEAR]


def engine_kv_groups(spec: ModelSpec) -> list[KVGroup]:
    """Attention groups first (their ids are the spec's), then the state groups."""
    groups = spec.kv_groups()
    linear = linear_layers(spec)
    if not linear:
        return groups
    if not groups:
        raise ConfigError(f"{spec.name}: a model without attention layers is not supported")
    size = max(len(g.layers) for g in groups)
    if len(linear) < size or len(groups) > 1:
        raise ConfigError(f"{spec.name}: a hybrid with fewer linear-attention layers than "
                          "attention layers, or several attention kinds, is not supported")
    for start in range(0, len(linear), size):
        groups.append(KVGroup(len(groups), AttentionKind.LINEAR, None,
                              tuple(linear[start:start + size])))
    return groups


def state_blocks_per_request(seq_len: int, block_size: int, *, prefix_caching: bool) -> int:
    """Most blocks one request holds in a state group (``kvmem.cache``'s ``StateManager``):
    with checkpoints (prefix caching), its state and the block it is carried into once it
    passes a block boundary; else the one block of its state."""
    return 2 if prefix_caching and seq_len > block_size else 1


def state_group_ids(groups: list[KVGroup]) -> list[int]:
    return [g.group_id for g in groups if g.kind is AttentionKind.LINEAR]


def engine_layer_slots(spec: ModelSpec) -> dict[int, int]:
    """Layer index -> the slot tensor it uses, linear-attention layers included."""
    return {layer: slot for g in engine_kv_groups(spec) for slot, layer in enumerate(g.layers)}


def state_block_size(spec: ModelSpec, block_size: int, tp: int) -> int:
    """The smallest block size from ``block_size`` up whose attention page on a rank holds
    one linear-attention layer's state there (``block_size`` for other models)."""
    states = [layer.state for layer in spec.layers
              if layer.kind is AttentionKind.LINEAR and layer.state is not None]
    attention = next((layer for layer in spec.layers if layer.has_own_cache), None)
    if not states or attention is None:
        return block_size
    state = max(sum(prod(shape) for shape, _ in s.shapes(tp)) for s in states)
    per_token = attention.elements_per_token(tp)  # MLA: the latent, on every rank
    needed = BLOCK_MULTIPLE * ceil(state / (per_token * BLOCK_MULTIPLE))
    return max(block_size, needed)
