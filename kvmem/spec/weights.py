"""Weight bytes per rank: exact from a checkpoint's safetensors headers, else estimated.

A rank holds its pipeline stage's decoder layers (split ``tp`` ways), plus the input
embedding on the first stage and the LM head and final norm on the last. Tied embeddings
are one tensor when one stage holds both ends; with pipeline parallelism the last stage
needs its own copy for the LM head.

With a checkpoint directory only the 8-byte header length and the JSON header of each
``*.safetensors`` file are read, never tensor data; a model read from the Hub carries the
same listing, from the headers there (``spec.extra["checkpoint"]``, kvmem.spec.hub). Without
one, parameter counts come from
the config (attention or MLA projections, dense MLP, MoE experts, shared experts and router,
linear-attention projections) and quantised checkpoints use ``spec.weight_bits`` for the
decoder's linear layers.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import cache, cached_property
from itertools import accumulate
from pathlib import Path
from typing import Any, NamedTuple

from kvmem.errors import ConfigError
from kvmem.spec.dtypes import dtype_bytes
from kvmem.spec.layout import AttentionKind, ModelSpec, StateKind

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")
_EMBED = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings")
_HEAD = ("lm_head", "model.norm.", "final_layernorm", "ln_f", "norm.weight", "output.weight")
_REPLICATED_KV = ("k_proj", "v_proj")
# a multimodal checkpoint's encoders and projector: their layers are not the decoder's
_ENCODERS = ("vision_tower.", "vision_model.", "multi_modal_projector.", "visual.",
             "audio_tower.")
_HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is not a header


class Tensor(NamedTuple):
    """One tensor of a checkpoint, as its safetensors header describes it."""

    name: str
    nbytes: int
    ndim: int


@dataclass(frozen=True)
class CheckpointTensors:
    """A checkpoint's tensors read elsewhere than a local directory (a Hub repo's headers),
    for the spec quantised at ``weight_bits``: a spec planned at other bits (an alternative
    the planner suggests) has its weights estimated."""

    tensors: tuple[Tensor, ...]
    weight_bits: float | None


@dataclass(frozen=True)
class WeightBreakdown:
    """Bytes one tensor-parallel rank holds: per decoder layer, embedding and LM head."""

    per_layer: tuple[int, ...]
    embedding: int  # input embedding (first stage)
    head: int  # LM head + final norm (last stage); excludes a tied embedding
    tied: bool
    other: int = 0  # checkpoint tensors outside the decoder (vision tower...): first stage
    exact: bool = False  # read from safetensors headers

    @cached_property
    def _prefix(self) -> list[int]:
        return [0, *accumulate(self.per_layer)]

    def stage_bytes(self, layers: range | list[int], is_first_stage: bool,
                    is_last_stage: bool, encoders: bool = True) -> int:
        """Bytes of a stage; ``encoders``: the first stage holds ``other`` too (vLLM loads
        a multimodal model's vision tower, kvmem's engine only the language model)."""
        if isinstance(layers, range) and layers.step == 1:  # a stage: O(1) for the search
            total = self._prefix[layers.stop] - self._prefix[layers.start] if layers else 0
        else:
            total = sum(self.per_layer[i] for i in layers)
        if is_first_stage:
            total += self.embedding + (self.other if encoders else 0)
        if is_last_stage:
            total += self.head
            if self.tied and not is_first_stage:  # the LM head reuses the embedding tensor
                total += self.embedding
        return total

    @property
    def total(self) -> int:
        return self.stage_bytes(range(len(self.per_layer)), True, True)


def weight_bytes_per_rank(spec: ModelSpec, layers: range | list[int], tp: int,
                          is_first_stage: bool, is_last_stage: bool,
                          checkpoint_dir: str | Path | None = None) -> int:
    """Weight bytes on one rank holding ``layers`` at tensor-parallel size ``tp``."""
    return weight_breakdown(spec, tp, checkpoint_dir).stage_bytes(
        layers, is_first_stage, is_last_stage)


def weight_breakdown(spec: ModelSpec, tp: int,
                     checkpoint_dir: str | Path | None = None) -> WeightBreakdown:
    if checkpoint_dir is not None:
        return _from_checkpoint(spec, tp, Path(checkpoint_dir))
    read = spec.extra.get("checkpoint") if isinstance(spec.extra, dict) else None
    if isinstance(read, CheckpointTensors) and read.weight_bits == spec.weight_bits:
        return _from_tensors(spec, tp, read.tensors)
    return _estimate(spec, tp)


# ---------------------------------------------------------------- exact: safetensors headers

def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (reads no tensor data)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ConfigError(f"{path}: not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", raw)
            if length > _HEADER_LIMIT:
                raise ConfigError(f"{path}: not a safetensors file (header of {length} bytes)")
            header = json.loads(f.read(length))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file (header is not an object)")
    return header


@cache
def _tensor_sizes(directory: str) -> tuple[Tensor, ...]:
    """(name, bytes, ndim) of every tensor in a checkpoint directory."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors files")
    tensors = []
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            try:
                start, end = info["data_offsets"]
                tensors.append(Tensor(name, int(end) - int(start), len(info["shape"])))
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{path}: tensor {name!r} has no valid data_offsets") from None
    return tuple(tensors)


def _from_checkpoint(spec: ModelSpec, tp: int, directory: Path) -> WeightBreakdown:
    if not directory.is_dir():
        raise ConfigError(f"{directory}: checkpoint directory not found")
    return _from_tensors(spec, tp, _tensor_sizes(str(directory.resolve())))


def _from_tensors(spec: ModelSpec, tp: int, tensors: tuple[Tensor, ...]) -> WeightBreakdown:
    per_layer = [0] * spec.num_layers
    embedding = head = other = 0
    kv_share = max(1, spec.num_kv_heads // tp) / spec.num_kv_heads
    for name, nbytes, ndim in tensors:
        # matrices are split across tensor-parallel ranks; norms and biases are tiny: kept whole
        if ndim < 2:
            shard = nbytes
        elif any(k in name for k in _REPLICATED_KV) and tp > spec.num_kv_heads:
            shard = round(nbytes * kv_share)
        else:
            shard = nbytes // tp
        if any(k in name for k in _ENCODERS):
            other += shard
        elif match := _LAYER.search(name):
            index = int(match.group(1))
            if index < spec.num_layers:  # extra layers (e.g. multi-token prediction) not loaded
                per_layer[index] += shard
        elif any(k in name for k in _EMBED):
            embedding += shard
        elif any(k in name for k in _HEAD):
            head += shard
        else:
            other += shard
    tied = spec.tie_word_embeddings and not any("lm_head" in t.name for t in tensors)
    return WeightBreakdown(tuple(per_layer), embedding, head, tied, other, exact=True)


# ---------------------------------------------------------------- estimate: config shapes

@dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one decoder layer (whole model, before tensor parallelism)."""

    attention: int  # q/o (and MLA or linear-attention projections)
    kv_proj: int  # k/v projections: replicated when tp exceeds the KV heads
    mlp: int  # dense MLP, or shared experts and router of a MoE layer
    experts: int  # routed experts
    norms: int


def _cfg(spec: ModelSpec) -> dict[str, Any]:
    return spec.extra.get("config", {}) if isinstance(spec.extra, dict) else {}


def _is_moe_layer(spec: ModelSpec, i: int) -> bool:
    moe = spec.moe
    if moe is None or i < moe.first_k_dense:
        return False
    return (i + 1) % max(1, moe.interleave_step) == 0


def _one_block_a_layer(cfg: dict) -> bool:
    """Nemotron-H: each layer is one Mamba, attention or MLP block, not attention + MLP."""
    return "hybrid_override_pattern" in cfg or "layers_block_type" in cfg


def layer_params(spec: ModelSpec, i: int) -> LayerParams:
    cfg = _cfg(spec)
    h, heads, hd = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    layer = spec.layers[i]
    kv_proj = 0
    if spec.mla is not None:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h * m.q_lora_rank + m.q_lora_rank * heads * qk) if m.q_lora_rank else h * heads * qk
        attention = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                     + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
                     + heads * m.v_head_dim * h)
    elif layer.kind is AttentionKind.NONE:  # Nemotron-H's MLP and MoE layers
        attention = 0
    elif layer.state is not None and layer.state.kind is StateKind.MAMBA2:
        st = layer.state
        heads_m, inner = st.temporal[0], st.temporal[0] * st.temporal[1]
        # in_proj (z, x, B, C, dt), conv, out_proj, and A, D, dt_bias
        attention = (h * (inner + st.conv_channels + heads_m)
                     + st.conv_channels * (st.conv_len + 1) + inner * h + 3 * heads_m)
    elif layer.state is not None and layer.state.kind is StateKind.SHORT_CONV:  # LFM2
        c = layer.state.conv_channels  # in_proj (B, C, x), depthwise conv, out_proj
        attention = h * 3 * c + c * (layer.state.conv_len + 1) + c * h
    elif layer.kind is AttentionKind.LINEAR:  # gated delta net (Qwen3-Next)
        kh, vh = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        kd, vd = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        conv = (2 * kh * kd + vh * vd) * int(cfg.get("linear_conv_kernel_dim") or 4)
        attention = h * (2 * kh * kd + 2 * vh * vd) + h * 2 * vh + conv + vh * vd * h
    else:
        gated_q = 2 if spec.model_type == "qwen3_next" else 1  # output gate folded into q_proj
        attention = h * heads * hd * gated_q + heads * hd * h
        kv_proj = 2 * h * spec.num_kv_heads * hd

    mlp = experts = 0
    moe = spec.moe
    if _one_block_a_layer(cfg) and layer.kind is not AttentionKind.NONE:
        pass  # Nemotron-H: a mixer layer has no MLP of its own
    elif _one_block_a_layer(cfg):
        mlp = 2 * h * spec.intermediate_size  # squared-ReLU MLP, no gate
    elif moe is not None and _is_moe_layer(spec, i):
        expert_i = moe.moe_intermediate_size
        # Granite MoE calls its shared MLP's size shared_intermediate_size
        shared_i = int(cfg.get("shared_expert_intermediate_size")
                       or cfg.get("shared_intermediate_size") or 0) \
            or expert_i * moe.num_shared_experts
        experts = moe.num_experts * 3 * h * expert_i
        mlp = 3 * h * shared_i + h * moe.num_experts
    else:
        dense_i = int(cfg.get("intermediate_size_mlp") or spec.intermediate_size) \
            if spec.model_type.startswith("llama4") else spec.intermediate_size
        mlp = 3 * h * dense_i
    return LayerParams(attention, kv_proj, mlp, experts, norms=2 * h)


def estimate_total_params(spec: ModelSpec) -> int:
    """Parameters of the language model (no vision tower, no multi-token-prediction layers)."""
    total = sum(p.attention + p.kv_proj + p.mlp + p.experts + p.norms
                for p in (layer_params(spec, i) for i in range(spec.num_layers)))
    embed = spec.vocab_size * spec.hidden_size
    return total + embed + (0 if spec.tie_word_embeddings else embed) + spec.hidden_size


def _quant_method(spec: ModelSpec) -> str:
    quant = _cfg(spec).get("quantization_config")
    return str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""


def _estimate(spec: ModelSpec, tp: int) -> WeightBreakdown:
    full = dtype_bytes(spec.dtype)
    quant = spec.weight_bits / 8 if spec.weight_bits else full
    experts_only = _quant_method(spec) == "mxfp4"  # gpt-oss: only the experts are MXFP4
    linear = full if experts_only else quant
    # vLLM's MXFP4 MoE kernels on Hopper pad the experts' hidden dimension to a multiple
    # of 256 (gpt-oss: 2880 -> 3072), as its logged weights show (13.47 and 64.38 GiB)
    pad = -(-spec.hidden_size // 256) * 256 / spec.hidden_size if experts_only else 1.0
    kv_share = max(1, spec.num_kv_heads // tp) / spec.num_kv_heads
    per_layer = []
    for i in range(spec.num_layers):
        p = layer_params(spec, i)
        per_layer.append(round(
            (p.attention / tp + p.kv_proj * kv_share + p.mlp / tp) * linear
            + p.experts / tp * quant * pad + p.norms * full))
    embedding = -(-spec.vocab_size // tp) * spec.hidden_size * full
    head = spec.hidden_size * full + (0 if spec.tie_word_embeddings else embedding)
    return WeightBreakdown(tuple(per_layer), embedding, head, spec.tie_word_embeddings)
