"""What every decoder of the engine shares: a pipeline stage's slice of the layers, the
forward pass over the paged KV cache, logits, and loading HuggingFace weights.

A model family subclasses ``DecoderForCausalLM`` and builds its modules: ``embed_tokens``
(first stage), ``layers`` (each with ``rope``, the index of its rotary embedding in
``rotaries``), ``norm`` and ``lm_head`` (last stage). A decoder layer takes ``(h,
residual, cos, sin, metadata, kv_cache)`` and returns ``(output, residual stream)``; the
next layer's first norm adds the two, fused where the device allows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kvmem.engine.attention import AttentionMetadata
from kvmem.engine.models import onednn_gemm
from kvmem.engine.models.layers import PackableLinear
from kvmem.engine.models.rope import RotaryEmbedding
from kvmem.spec import AttentionKind, ModelSpec, spec_from_config, text_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def kw(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}


@dataclass(frozen=True)
class LayerPlacement:
    """Where one decoder layer reads and writes its KV: its group and window."""

    group_id: int
    sliding_window: int | None


def layer_placements(spec: ModelSpec) -> list[LayerPlacement]:
    """Every layer's KV group (``ModelSpec.kv_groups``) and sliding window (None: full)."""
    group_of = {layer: g.group_id for g in spec.kv_groups() for layer in g.layers}
    return [LayerPlacement(group_of[kv.index],
                           kv.window if kv.kind is AttentionKind.SLIDING else None)
            for kv in spec.layers]


class DecoderForCausalLM(nn.Module):
    """A decoder that holds the layers ``layers`` (a pipeline stage) of the model.

    The first stage embeds tokens; the last stage applies the final norm and owns the
    LM head. ``kv_caches[i]`` is the slot tensor of the i-th layer this stage holds (a
    list over all the model's layers is accepted too).
    """

    embed_tokens: nn.Module | None
    layers: nn.ModuleList
    norm: nn.Module | None
    lm_head: nn.Module | None
    rotaries: list[RotaryEmbedding]
    # fused checkpoint projections: HF name -> (this module's name, shard id)
    _PACKED: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint name prefixes read as another (a multimodal checkpoint's language model)
    _RENAMED: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: dict[str, Any], layers: range | None) -> None:
        super().__init__()
        self.config = text_config(config)
        self.spec = spec = spec_from_config(config)
        self.num_hidden_layers = spec.num_layers
        self.layer_ids = layers if layers is not None else range(spec.num_layers)
        self.is_first = self.layer_ids.start == 0
        self.is_last = self.layer_ids.stop == spec.num_layers
        self.tie_word_embeddings = spec.tie_word_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                metadata: AttentionMetadata, kv_caches: list[torch.Tensor],
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]``: final-normed on the last stage, else the residual."""
        if self.is_first:
            h = self.embed(input_ids)
        elif hidden_states is None:
            raise ValueError("a pipeline stage after the first needs hidden_states")
        else:
            h = hidden_states
        offset = 0 if len(kv_caches) == len(self.layers) else self.layer_ids.start
        # once per step for all layers, already in the activations' dtype
        cos_sin = [[t.to(h.dtype) for t in rotary.cos_sin(positions)]
                   for rotary in self.rotaries]
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, *cos_sin[layer.rope], metadata,
                                kv_caches[offset + i])
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
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HuggingFace-named tensors into this stage's parameters; returns names loaded.

        Tensors this stage has no parameter for (other stages' layers, a vision tower)
        are skipped. Raises ValueError when a parameter of this stage got no weight.
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
        for prefix, replacement in self._RENAMED:
            if hf_name.startswith(prefix):
                hf_name = replacement + hf_name[len(prefix):]
                break
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
