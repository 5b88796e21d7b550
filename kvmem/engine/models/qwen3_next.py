"""Qwen3-Next and Qwen3.5: Gated DeltaNet linear-attention layers and, every
``full_attention_interval`` layers, gated full attention; a sparse MoE MLP with a gated
shared expert, or a dense MLP.

Against the Llama decoder: RMSNorms scale by ``1 + weight``; full attention projects a
sigmoid output gate with each query head (``q_proj`` holds ``[q, gate]`` per head), has
per-head q/k norms and rotates only ``partial_rotary_factor`` of each head; the linear
layers are ``gated_delta_net.GatedDeltaNet``, their states in the engine's state groups
(``kvmem.spec.state_groups``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvmem.engine.attention import AttentionBackend, AttentionMetadata
from kvmem.engine.models.decoder import DecoderForCausalLM, ParallelConfig
from kvmem.engine.models.gated_delta_net import GatedDeltaNet
from kvmem.engine.models.layers import (
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _all_reduce,
    _copy,
    _param,
)
from kvmem.engine.models.rope import RotaryEmbedding
from kvmem.errors import ConfigError
from kvmem.spec import AttentionKind
from kvmem.spec.state_groups import engine_kv_groups


class GatedAttention(nn.Module):
    """Full attention with a per-head sigmoid output gate and partial RoPE."""

    def __init__(self, config: dict[str, Any], head_dim: int, rotary_dim: int,
                 backend: AttentionBackend, group_id: int, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        if heads % parallel.tp_size:
            raise ValueError(f"{heads} attention heads do not split over {parallel.tp_size} ranks")
        bias = bool(config.get("attention_bias", False))
        # q_proj's rows are [q, gate] per head: as 2 x heads "heads", a rank's are its own
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, 2 * heads, kv_heads, bias,
                                          **parallel.kw)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias, **parallel.kw)
        self.num_heads = heads // parallel.tp_size
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm, self.k_norm = GemmaRMSNorm(head_dim, eps), GemmaRMSNorm(head_dim, eps)
        self.backend, self.group_id = backend, group_id

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([RotaryEmbedding.apply(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q_gate.view(t, self.num_heads, 2 * hd).chunk(2, dim=-1)
        q = self._rotate(self.q_norm(q), cos, sin)
        k = self._rotate(self.k_norm(k.reshape(t, self.num_kv_heads, hd)), cos, sin)
        v = v.reshape(t, self.num_kv_heads, hd)
        out = self.backend.forward(q.contiguous(), k.contiguous(), v, kv_cache, metadata,
                                   self.group_id, hd ** -0.5, None)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class Expert(nn.Module):
    """A SwiGLU MLP whose output is this rank's partial sum (reduced by the caller)."""

    def __init__(self, hidden: int, inter: int, parallel: ParallelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False,
                                                       **parallel.kw)
        self.down_proj = RowParallelLinear(inter, hidden, False, **parallel.kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj.matmul(F.silu(gate) * up)


def _replicated(shape: tuple[int, ...]) -> nn.Parameter:
    return _param(shape, lambda p, w, shard_id=None: _copy(p, w))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (softmax router, optionally renormalised) plus a shared expert
    scaled by ``sigmoid(shared_expert_gate(x))``; one all-reduce over tensor-parallel
    ranks, each of which holds every expert's slice of the intermediate size."""

    def __init__(self, config: dict[str, Any], parallel: ParallelConfig) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k = config["num_experts_per_tok"]
        self.norm_topk_prob = bool(config.get("norm_topk_prob", True))
        self.tp_size = parallel.tp_size
        self.gate = nn.Module()
        self.gate.weight = _replicated((config["num_experts"], hidden))
        self.experts = nn.ModuleList(Expert(hidden, config["moe_intermediate_size"], parallel)
                                     for _ in range(config["num_experts"]))
        shared = config.get("shared_expert_intermediate_size") or 0
        self.shared_expert = Expert(hidden, shared, parallel) if shared else None
        self.shared_expert_gate = nn.Module() if shared else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.weight = _replicated((1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(x)
        return _all_reduce(out, self.tp_size)


class Qwen3NextDecoderLayer(nn.Module):
    rope = 0

    def __init__(self, config: dict[str, Any], mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.linear = isinstance(mixer, GatedDeltaNet)
        # the checkpoint's names: linear_attn or self_attn
        self.add_module("linear_attn" if self.linear else "self_attn", mixer)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual, x = self.input_layernorm.add_and_norm(h, residual)
        if self.linear:
            mixed = self.linear_attn(x, metadata, kv_cache)
        else:
            mixed = self.self_attn(x, cos, sin, metadata, kv_cache)
        residual, x = self.post_attention_layernorm.add_and_norm(mixed, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next's decoder for one pipeline stage (``DecoderForCausalLM``), and Qwen3.5's
    text decoder (``Qwen3_5ForCausalLM``: unfused Gated DeltaNet projections, its text-only
    multimodal RoPE the plain one)."""

    def __init__(self, config: dict[str, Any], backend: AttentionBackend, *,
                 architecture: str = "Qwen3NextForCausalLM", tp_rank: int = 0,
                 tp_size: int = 1, layers: range | None = None) -> None:
        super().__init__(config, layers)
        config, spec = self.config, self.spec
        parallel = ParallelConfig(tp_rank, tp_size)
        hidden, vocab, head_dim = spec.hidden_size, spec.vocab_size, spec.head_dim
        rope = config.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor",
                                config.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * factor)
        self.rotaries = [RotaryEmbedding(rotary_dim, config)]
        group_of = {layer: g.group_id for g in engine_kv_groups(spec) for layer in g.layers}
        num_attention_groups = len(spec.kv_groups())
        sparse_step = int(config.get("decoder_sparse_step", 1) or 1)
        dense = set(config.get("mlp_only_layers") or [])

        def mlp(i: int) -> nn.Module:
            if config.get("num_experts") and i not in dense and (i + 1) % sparse_step == 0:
                return SparseMoeBlock(config, parallel)
            return _DenseMLP(hidden, config["intermediate_size"], parallel)

        def mixer(i: int) -> nn.Module:
            kind = spec.layers[i].kind
            if kind is AttentionKind.LINEAR:
                return GatedDeltaNet(config, group_of[i] - num_attention_groups, parallel,
                                     fused=architecture == "Qwen3NextForCausalLM")
            if kind is not AttentionKind.FULL:
                raise ConfigError(f"Qwen3-Next layer {i}: {kind.value} is not supported")
            return GatedAttention(config, head_dim, rotary_dim, backend, group_of[i], parallel)

        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, **parallel.kw) \
            if self.is_first else None
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, mixer(i), mlp(i))
                                    for i in self.layer_ids)
        eps = config.get("rms_norm_eps", 1e-6)
        self.norm = GemmaRMSNorm(hidden, eps) if self.is_last else None
        self.lm_head = ParallelLMHead(vocab, hidden, **parallel.kw) if self.is_last else None

    def _targets(self, hf_name: str) -> list[tuple[str, object]]:
        # q_proj is the fused projection's 2 x heads "q"; experts keep gate and up apart
        parts = hf_name.split(".")
        if len(parts) > 5 and parts[3] == "mlp" and parts[-2] in ("gate_proj", "up_proj"):
            shard = int(parts[-2] == "up_proj")
            parts[-2] = "gate_up_proj"
            return [(name, shard) for name, _ in super()._targets(".".join(parts))]
        return super()._targets(hf_name)


class _DenseMLP(Expert):
    """A SwiGLU MLP (layers listed in ``mlp_only_layers``), reduced over ranks."""

    def __init__(self, hidden: int, inter: int, parallel: ParallelConfig) -> None:
        super().__init__(hidden, inter, parallel)
        self.tp_size = parallel.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(super().forward(x), self.tp_size)
