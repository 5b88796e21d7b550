"""Gemma 3's text decoder over a paged KV cache: ``Gemma3ForCausalLM``, and the language
model of ``Gemma3ForConditionalGeneration`` (its vision tower is not loaded).

Against the Llama decoder: token embeddings scaled by ``sqrt(hidden_size)``; RMSNorms
scaled by ``1 + weight``; per-head RMSNorm on q and k; a norm before and after both the
attention and the MLP; a GeGLU MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``;
sliding-window (local) layers with their own RoPE base and global layers with
``rope_theta`` and the RoPE scaling; logits soft-capped by tanh when
``final_logit_softcapping`` is set. Which layers slide comes from the spec
(``layer_types`` or ``sliding_window_pattern``), as do their KV groups.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvmem.engine.attention import AttentionBackend, AttentionMetadata
from kvmem.engine.models.decoder import DecoderForCausalLM, ParallelConfig, layer_placements
from kvmem.engine.models.layers import GemmaRMSNorm, ParallelLMHead, VocabParallelEmbedding
from kvmem.engine.models.llama import LlamaAttention, LlamaMLP, LlamaVariant
from kvmem.engine.models.rope import RotaryEmbedding
from kvmem.errors import ConfigError

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def layer_type_rope(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The RoPE config of local (sliding) or global (full) layers, for ``RotaryEmbedding``.

    Configs written by recent transformers hold one ``rope_parameters`` entry per layer
    type; checkpoints give local layers ``rope_local_base_freq`` and global ones
    ``rope_theta`` and ``rope_scaling``.
    """
    if layer_type == LOCAL:
        base: dict[str, Any] = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    else:
        base = {"rope_theta": config.get("rope_theta", 1_000_000.0),
                "rope_scaling": config.get("rope_scaling")}
    per_type = config.get("rope_parameters")
    if isinstance(per_type, dict) and isinstance(per_type.get(layer_type), dict):
        base = {"rope_theta": base["rope_theta"], "rope_parameters": per_type[layer_type]}
    return {**base, "max_position_embeddings": config.get("max_position_embeddings")}


def check_supported(config: dict[str, Any]) -> None:
    if config.get("attn_logit_softcapping") is not None:
        raise ConfigError("Gemma 3 with attn_logit_softcapping is not supported")
    if config.get("use_bidirectional_attention"):
        raise ConfigError("Gemma 3 with use_bidirectional_attention is not supported "
                          "(an embedding model)")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], attention: LlamaAttention, mlp: LlamaMLP,
                 rope: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.rope = rope
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed mlp output, residual stream)``: the caller adds them."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add_and_norm(h, residual)
        attended = self.post_attention_layernorm(self.self_attn(x, cos, sin, metadata, kv_cache))
        residual, x = self.pre_feedforward_layernorm.add_and_norm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's text decoder for one pipeline stage (``DecoderForCausalLM``)."""

    # a multimodal checkpoint's language model: transformers < 4.52 and >= 5 write the
    # first, 4.52 to 4.57 the second
    _RENAMED = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."))

    def __init__(self, config: dict[str, Any], backend: AttentionBackend, *,
                 architecture: str = "Gemma3ForCausalLM", tp_rank: int = 0, tp_size: int = 1,
                 layers: range | None = None) -> None:
        super().__init__(config, layers)
        config, spec = self.config, self.spec
        check_supported(config)
        bias = bool(config.get("attention_bias", False))
        variant = LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True)
        parallel = ParallelConfig(tp_rank, tp_size)
        hidden, vocab = spec.hidden_size, spec.vocab_size
        scale = float(config.get("query_pre_attn_scalar", spec.head_dim)) ** -0.5
        activation = config.get("hidden_activation", "gelu_pytorch_tanh")
        self.rotaries = [RotaryEmbedding(spec.head_dim, layer_type_rope(config, kind))
                         for kind in (GLOBAL, LOCAL)]
        self.final_logit_softcapping = config.get("final_logit_softcapping")

        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, **parallel.kw) \
            if self.is_first else None
        self.embed_scale = math.sqrt(hidden)
        placements = layer_placements(spec)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config,
                LlamaAttention(config, variant, spec.head_dim, backend, placements[i], parallel,
                               scale=scale, norm=GemmaRMSNorm),
                LlamaMLP(config, False, parallel, activation),
                rope=0 if placements[i].sliding_window is None else 1)
            for i in self.layer_ids)
        eps = config.get("rms_norm_eps", 1e-6)
        self.norm = GemmaRMSNorm(hidden, eps) if self.is_last else None
        self.lm_head = ParallelLMHead(vocab, hidden, **parallel.kw) if self.is_last else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # the scale rounded to the model's dtype first, as transformers does (a Python
        # number: no host-to-device copy inside a CUDA graph)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype).item()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
