"""Upper bounds on a config.json's sizes, checked before anything is built from them.

A model's layers are built one object per layer, and the planner's searches grow with
their number, so a config naming 10^9 layers would exhaust the host before any other
check ran; a page serving the planner takes configs from anyone. Each bound is far above
any published model (the deepest, Llama 3.1 405B, has 126 layers; the widest vocabulary
is about 262k tokens; the most routed experts 512), so only a config no model has is
refused: one line naming the field, its value and the bound.
"""

from __future__ import annotations

from typing import Any

from kvmem.errors import ConfigError

MAX_LAYERS = 1024
_HEADS = 4096
_DIM = 65_536
_EXPERTS = 4096
_TOKENS = 1 << 30  # context lengths and windows: 1,073,741,824 tokens

BOUNDS: dict[str, int] = {
    "num_hidden_layers": MAX_LAYERS, "num_nextn_predict_layers": 64,
    "hidden_size": 1 << 17, "vocab_size": 1 << 22,
    "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20, "shared_intermediate_size": 1 << 20,
    "num_attention_heads": _HEADS, "num_key_value_heads": _HEADS, "head_dim": _DIM,
    "max_position_embeddings": _TOKENS, "sliding_window": _TOKENS,
    "attention_chunk_size": _TOKENS, "index_topk": _TOKENS,
    "num_experts": _EXPERTS, "num_local_experts": _EXPERTS, "n_routed_experts": _EXPERTS,
    "n_shared_experts": _EXPERTS, "num_shared_experts": _EXPERTS,
    "num_experts_per_tok": _EXPERTS, "experts_per_token": _EXPERTS,
    "kv_lora_rank": _DIM, "q_lora_rank": _DIM, "qk_rope_head_dim": _DIM,
    "qk_nope_head_dim": _DIM, "v_head_dim": _DIM, "index_head_dim": _DIM,
    "linear_num_key_heads": _HEADS, "linear_num_value_heads": _HEADS,
    "linear_key_head_dim": _DIM, "linear_value_head_dim": _DIM,
    "mamba_num_heads": _HEADS, "mamba_n_heads": _HEADS, "mamba_head_dim": _DIM,
    "mamba_d_head": _DIM, "ssm_state_size": _DIM, "mamba_d_state": _DIM,
    "n_groups": _HEADS, "mamba_n_groups": _HEADS, "mamba_expand": 64,
    "conv_kernel": 1024, "mamba_d_conv": 1024, "linear_conv_kernel_dim": 1024,
    # layer patterns: a step or count of layers
    "first_k_dense_replace": MAX_LAYERS, "interleave_moe_layer_step": MAX_LAYERS,
    "sliding_window_pattern": MAX_LAYERS, "full_attention_interval": MAX_LAYERS,
    "no_rope_layer_interval": MAX_LAYERS, "max_window_layers": MAX_LAYERS,
    "num_kv_shared_layers": MAX_LAYERS, "index_topk_freq": MAX_LAYERS,
    "index_skip_topk_offset": MAX_LAYERS,
    "total_params": 1 << 50,
}
# one entry per layer (or a list of layers)
LAYER_LISTS = ("layer_types", "no_rope_layers", "layers_block_type", "attn_layer_indices",
               "index_topk_pattern", "hybrid_override_pattern")


def check_bounds(cfg: dict[str, Any], where: str) -> None:
    """Refuse a size above its bound in a (flattened) config; other checks stay the
    loader's (a wrong type, a negative or missing value)."""
    for key, bound in BOUNDS.items():
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value > bound:  # inf too; NaN and negatives are the loader's to refuse
            raise ConfigError(f"{where}: field {key!r} must be at most {bound:,}, "
                              f"got {value!r}")
    for key in LAYER_LISTS:
        value = cfg.get(key)
        if isinstance(value, (list, str)) and len(value) > MAX_LAYERS:
            raise ConfigError(f"{where}: field {key!r} has {len(value):,} entries, at most "
                              f"{MAX_LAYERS:,} (one per layer)")
