"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

One class covers the family; the variants differ only in ``LlamaVariant``: bias on the
q/k/v projections (Qwen2), per-head RMSNorm on q and k (Qwen3), and head_dim taken from
the config when given. Layers attend through an attention backend that writes and reads
the engine's KV slot tensors; what every decoder shares (stages, the forward pass, weight
loading) is ``decoder.DecoderForCausalLM``. Its attention and MLP serve Gemma 3 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvmem.engine.attention import AttentionBackend, AttentionMetadata
from kvmem.engine.models import cpu_ops
from kvmem.engine.models.decoder import (
    DecoderForCausalLM,
    LayerPlacement,
    ParallelConfig,
    layer_placements,
)
from kvmem.engine.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvmem.engine.models.rope import RotaryEmbedding
from kvmem.errors import ConfigError


@dataclass(frozen=True)
class LlamaVariant:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def for_config(cls, architecture: str, config: dict[str, Any]) -> LlamaVariant:
        attention_bias = bool(config.get("attention_bias", False))
        if architecture == "Qwen2ForCausalLM":
            return cls(qkv_bias=True)
        if architecture == "Qwen3ForCausalLM":
            return cls(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
        return cls(qkv_bias=attention_bias, o_bias=attention_bias,
                   mlp_bias=bool(config.get("mlp_bias", False)))


class LlamaAttention(nn.Module):
    """q/k/v projections, per-head q/k norms (``variant.qk_norm``, of class ``norm``), RoPE,
    paged attention scaled by ``scale`` (default ``head_dim ** -0.5``), output projection."""

    def __init__(self, config: dict[str, Any], variant: LlamaVariant, head_dim: int,
                 backend: AttentionBackend, placement: LayerPlacement, parallel: ParallelConfig,
                 *, scale: float | None = None, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, variant.qkv_bias,
                                          **parallel.kw)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, variant.o_bias, **parallel.kw)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = norm(head_dim, eps) if variant.qk_norm else None
        self.k_norm = norm(head_dim, eps) if variant.qk_norm else None
        self.backend = backend
        self.group_id = placement.group_id
        self.sliding_window = placement.sliding_window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        rotated = self.q_norm is None and cpu_ops.rotary_qk_(
            qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotated:
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.group_id, self.scale,
                                   self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (``silu``) or GeGLU (``gelu_pytorch_tanh``)."""

    def __init__(self, config: dict[str, Any], bias: bool, parallel: ParallelConfig,
                 activation: str | None = None) -> None:
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        act = activation or config.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.silu = act == "silu"
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias,
                                                       **parallel.kw)
        self.down_proj = RowParallelLinear(inter, hidden, bias, **parallel.kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = cpu_ops.silu_mul(gate_up) if self.silu else None
        if fused is not None:
            return self.down_proj(fused)
        gate, up = gate_up.chunk(2, dim=-1)
        # in place: the fused projection's output is this step's own scratch
        if self.silu:
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class LlamaDecoderLayer(nn.Module):
    rope = 0  # the model's only rotary embedding

    def __init__(self, config: dict[str, Any], attention: LlamaAttention, mlp: LlamaMLP
                 ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the caller adds them, fused into the next norm.

        ``residual`` None means ``h`` is the stream itself (the stage's first layer).
        """
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add_and_norm(h, residual)
        attended = self.self_attn(x, cos, sin, metadata, kv_cache)
        residual, x = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(DecoderForCausalLM):
    """The Llama family's decoder for one pipeline stage (``DecoderForCausalLM``)."""

    def __init__(self, config: dict[str, Any], backend: AttentionBackend, *,
                 architecture: str = "LlamaForCausalLM", tp_rank: int = 0, tp_size: int = 1,
                 layers: range | None = None) -> None:
        super().__init__(config, layers)
        config, spec = self.config, self.spec
        variant = LlamaVariant.for_config(architecture, config)
        parallel = ParallelConfig(tp_rank, tp_size)
        hidden, vocab = spec.hidden_size, spec.vocab_size
        placements = layer_placements(spec)
        self.rotaries = [RotaryEmbedding(spec.head_dim, config)]

        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, **parallel.kw) \
            if self.is_first else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, LlamaAttention(config, variant, spec.head_dim, backend,
                                                     placements[i], parallel),
                              LlamaMLP(config, variant.mlp_bias, parallel))
            for i in self.layer_ids)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6)) if self.is_last else None
        self.lm_head = ParallelLMHead(vocab, hidden, **parallel.kw) if self.is_last else None
