"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

One class covers the family; the variants differ only in ``LlamaVariant``: bias on the
q/k/v projections (Qwen2), per-head RMSNorm on q and k (Qwen3), and head_dim taken from
the config when given. Layers attend through an attention backend that writes and reads
the engine's KV slot tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvmem.engine.attention import AttentionBackend, AttentionMetadata
from kvmem.engine.models import cpu_ops, onednn_gemm
from kvmem.engine.models.layers import (
    MergedColumnParallelLinear,
    PackableLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvmem.engine.models.rope import RotaryEmbedding
from kvmem.errors import ConfigError
from kvmem.spec import AttentionKind, spec_from_config

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class ParallelConfig:
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def kw(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}


class LlamaAttention(nn.Module):
    def __init__(self, config: dict[str, Any], variant: LlamaVariant, head_dim: int,
                 rotary: RotaryEmbedding, backend: AttentionBackend, group_id: int,
                 sliding_window: int | None, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, variant.qkv_bias,
                                          **parallel.kw)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, variant.o_bias, **parallel.kw)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if variant.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.group_id = group_id
        self.sliding_window = sliding_window

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
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.group_id, self.scale,
                                   self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: dict[str, Any], bias: bool, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"activation {act!r} is not supported (silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias,
                                                       **parallel.kw)
        self.down_proj = RowParallelLinear(inter, hidden, bias, **parallel.kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = cpu_ops.silu_mul(gate_up)
        if fused is not None:
            return self.down_proj(fused)
        gate, up = gate_up.chunk(2, dim=-1)
        # in place: the fused projection's output is this step's own scratch
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
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


class LlamaForCausalLM(nn.Module):
    """A decoder that holds the layers ``layers`` (a pipeline stage) of the model.

    The first stage embeds tokens; the last stage applies the final norm and owns the
    LM head. ``kv_caches[i]`` is the slot tensor of the i-th layer this stage holds (a
    list over all the model's layers is accepted too).
    """

    def __init__(self, config: dict[str, Any], backend: AttentionBackend, *,
                 architecture: str = "LlamaForCausalLM", tp_rank: int = 0, tp_size: int = 1,
                 layers: range | None = None) -> None:
        super().__init__()
        spec = spec_from_config(config)
        self.config = config
        self.spec = spec
        self.num_hidden_layers = spec.num_layers
        self.layer_ids = layers if layers is not None else range(spec.num_layers)
        self.is_first = self.layer_ids.start == 0
        self.is_last = self.layer_ids.stop == spec.num_layers
        self.tie_word_embeddings = spec.tie_word_embeddings
        variant = LlamaVariant.for_config(architecture, config)
        parallel = ParallelConfig(tp_rank, tp_size)
        hidden, vocab = spec.hidden_size, spec.vocab_size
        group_of = {layer: g.group_id for g in spec.kv_groups() for layer in g.layers}
        self.rotary = RotaryEmbedding(spec.head_dim, config)

        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, **parallel.kw) \
            if self.is_first else None
        decoder = []
        for i in self.layer_ids:
            layer_kv = spec.layers[i]
            window = layer_kv.window if layer_kv.kind is AttentionKind.SLIDING else None
            attention = LlamaAttention(config, variant, spec.head_dim, self.rotary, backend,
                                       group_of[i], window, parallel)
            decoder.append(LlamaDecoderLayer(config, attention,
                                             LlamaMLP(config, variant.mlp_bias, parallel)))
        self.layers = nn.ModuleList(decoder)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6)) if self.is_last else None
        self.lm_head = ParallelLMHead(vocab, hidden, **parallel.kw) if self.is_last else None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                metadata: AttentionMetadata, kv_caches: list[torch.Tensor],
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]``: final-normed on the last stage, else the residual."""
        if self.is_first:
            h = self.embed_tokens(input_ids)
        elif hidden_states is None:
            raise ValueError("a pipeline stage after the first needs hidden_states")
        else:
            h = hidden_states
        offset = 0 if len(kv_caches) == len(self.layers) else self.layer_ids.start
        # once per step for all layers, already in the activations' dtype
        cos, sin = (t.to(h.dtype) for t in self.rotary.cos_sin(positions))
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, metadata, kv_caches[offset + i])
        if residual is None:  # a stage without layers
            return self.norm(h) if self.norm is not None else h
        if self.norm is None:
            return h + residual
        return self.norm.add_and_norm(h, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in fp32 (last pipeline stage only)."""
        if self.lm_head is None:
            raise ValueError("only the last pipeline stage computes logits")
        return self.lm_head.logits(hidden).float()

    # ---- weights -------------------------------------------------------------------
    _PACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HuggingFace-named tensors into this stage's parameters; returns names loaded.

        Raises ValueError when a parameter of this stage got no weight.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            for name, shard_id in self._targets(hf_name):
                param = params.get(name)
                if param is None:
                    continue
                param.weight_loader(param, tensor.to(param.dtype), shard_id)
                loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint has no weights for {sorted(missing)[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}")
        self.process_weights_after_loading()
        return loaded

    def process_weights_after_loading(self) -> None:
        """Lay out the projections' and LM head's weights the way this device multiplies
        them fastest (``PackableLinear.pack_weight``)."""
        widened = 0
        for module in self.modules():
            if isinstance(module, PackableLinear):
                bf16 = module.weight.dtype == torch.bfloat16
                module.pack_weight()
                if bf16 and module.packed is not None:
                    packed = module.packed
                    widened += packed.nbytes - packed.out_features * packed.in_features * 2
        if widened:
            why = ("no AMX; KVMEM_CPU_BF16_WEIGHTS=bf16 keeps them in bf16 only"
                   if onednn_gemm.available(torch.bfloat16) else
                   "oneDNN's bf16 GEMM needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
            logger.info("bf16 projection weights run as fp32 on this CPU (%s), "
                        "decode-sized batches on their bf16 copy where the CPU has AVX-512 "
                        "BF16: %.0f MiB more memory", why, widened / 2**20)

    def _targets(self, hf_name: str) -> list[tuple[str, object]]:
        """This module's parameter name(s) for a HuggingFace weight name."""
        if hf_name == "lm_head.weight":
            return [("lm_head.weight", None)]
        if hf_name == "model.embed_tokens.weight":
            out = [("embed_tokens.weight", None)]
            if self.tie_word_embeddings:
                out.append(("lm_head.weight", None))
            return out
        if not hf_name.startswith("model."):
            return []
        name = hf_name[len("model."):]
        parts = name.split(".")
        if parts[0] == "layers":
            index = int(parts[1])
            if index not in self.layer_ids:
                return []
            parts[1] = str(index - self.layer_ids.start)
            packed = self._PACKED.get(parts[3]) if len(parts) > 4 else None
            if packed is not None:
                parts[3] = packed[0]
                return [(".".join(parts), packed[1])]
        return [(".".join(parts), None)]
