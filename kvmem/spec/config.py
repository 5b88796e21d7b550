"""Read a HuggingFace ``config.json`` (dict, file, directory or catalog name) into a ModelSpec."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.files import read_bounded
from kvmem.spec.dtypes import canonical_dtype
from kvmem.spec.layout import MLA, AttentionKind, LayerKV, ModelSpec, MoE

_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


# What a family's transformers config class fills in for fields config.json leaves out:
# gemma-3-4b-it's text_config names only its sizes, sliding window and RoPE scaling.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
_FAMILY_DEFAULTS = {"gemma3": _GEMMA3_TEXT_DEFAULTS, "gemma3_text": _GEMMA3_TEXT_DEFAULTS}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config, flat, with the family's defaults for absent fields.

    Multimodal configs (Gemma 3, Llama 4) keep the language model under ``text_config``;
    its fields win over the outer ones, which it inherits otherwise (``architectures``,
    ``torch_dtype``).
    """
    text = cfg.get("text_config")
    if isinstance(text, dict) and ("num_hidden_layers" in text or "num_hidden_layers" not in cfg):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}
    defaults = _FAMILY_DEFAULTS.get(str(cfg.get("model_type")))
    return {**defaults, **cfg} if defaults else cfg


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None,
         low: int | None = 0) -> int | None:
    """An integer field (``default`` when absent or null); a wrong type or a value below
    ``low`` is a one-line ConfigError naming the field and the value."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: field {key!r} must be an integer, got {value!r}")
    if low is not None and value < low:
        need = {0: "not be negative", 1: "be positive"}.get(low, f"be >= {low}")
        raise ConfigError(f"{where}: field {key!r} must {need}, got {value!r}")
    return value


def _window(cfg: dict[str, Any], where: str, used: bool) -> int | None:
    """``sliding_window``; it must be positive when the family slides (``used``)."""
    window = _int(cfg, "sliding_window", where, low=None)
    if window is not None and (window < 0 or (used and window == 0)):
        raise ConfigError(f"{where}: field 'sliding_window' must be positive, got {window!r}")
    return window


def _slides(cfg: dict[str, Any]) -> bool:
    """Whether the model's family uses ``sliding_window`` (when it is set)."""
    model_type = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return "sliding_attention" in types
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        return bool(cfg.get("use_sliding_window"))
    return not cfg.get("full_attention_interval") and not cfg.get("attention_chunk_size")


def _layer_kinds(cfg: dict[str, Any], n: int, where: str) -> list[tuple[AttentionKind, int | None]]:
    """Each layer's attention kind and window, from whichever pattern field the family uses."""
    model_type = str(cfg.get("model_type", ""))
    window = _window(cfg, where, _slides(cfg))
    chunk = _int(cfg, "attention_chunk_size", where)
    sliding = (AttentionKind.SLIDING, window)
    full = (AttentionKind.FULL, None)

    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        if len(layer_types) != n:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {n} layers")
        names = {
            "full_attention": full, "sliding_attention": sliding,
            "chunked_attention": (AttentionKind.CHUNKED, chunk),
            "linear_attention": (AttentionKind.LINEAR, None),
        }
        try:
            return [names[t] for t in layer_types]
        except KeyError as e:
            raise ConfigError(f"{where}: unknown layer type {e.args[0]!r} in layer_types") from None

    if step := _int(cfg, "full_attention_interval", where):  # Qwen3-Next: every n-th full
        return [full if (i + 1) % step == 0 else (AttentionKind.LINEAR, None) for i in range(n)]

    if chunk:  # Llama 4: chunked layers, NoPE layers are global
        rope = cfg.get("no_rope_layers")
        if not isinstance(rope, list) or len(rope) != n:
            step = _int(cfg, "no_rope_layer_interval", where, 4, low=1)
            rope = [0 if (i + 1) % step == 0 else 1 for i in range(n)]
        return [(AttentionKind.CHUNKED, chunk) if r else full for r in rope]

    if model_type.startswith("gemma3") and window:
        step = _int(cfg, "sliding_window_pattern", where) or 6
        return [full if (i + 1) % step == 0 else sliding for i in range(n)]
    if model_type == "gemma2" and window:
        return [sliding if i % 2 == 0 else full for i in range(n)]
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if cfg.get("use_sliding_window") and window:
            start = _int(cfg, "max_window_layers", where, n)
            return [sliding if i >= start else full for i in range(n)]
        return [full] * n
    if window and window < (_int(cfg, "max_position_embeddings", where) or 1 << 62):
        return [sliding] * n  # Mistral v0.1, Phi-3: every layer slides
    return [full] * n


def _first_int(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> int:
    """The first of ``keys`` that is set and non-zero (0 when none is)."""
    for key in keys:
        if value := _int(cfg, key, where):
            return value
    return 0


def _moe(cfg: dict[str, Any], where: str) -> MoE | None:
    experts = _first_int(cfg, ("num_experts", "num_local_experts", "n_routed_experts"), where)
    if not experts:
        return None
    shared = _first_int(cfg, ("n_shared_experts", "num_shared_experts"), where)
    if not shared and _int(cfg, "shared_expert_intermediate_size", where):
        shared = 1
    return MoE(
        num_experts=experts,
        experts_per_token=_first_int(cfg, ("num_experts_per_tok", "experts_per_token"),
                                     where) or 1,
        # Llama 4 calls its expert size intermediate_size (intermediate_size_mlp is dense)
        moe_intermediate_size=_first_int(cfg, ("moe_intermediate_size", "intermediate_size"),
                                         where),
        num_shared_experts=shared,
        first_k_dense=_int(cfg, "first_k_dense_replace", where, 0),
        interleave_step=_int(cfg, "interleave_moe_layer_step", where) or 1,
    )


def _weight_bits(cfg: dict[str, Any], where: str) -> float | None:
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8" or "fp8" in str(quant.get("fmt", "")):
        return 8.0
    if method == "mxfp4":
        return 4.25
    for key in ("bits", "w_bit"):
        bits = quant.get(key)
        if bits is None:
            continue
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) \
                or not math.isfinite(bits) or not 0 <= bits <= 64:
            raise ConfigError(f"{where}: field 'quantization_config.{key}' must be a number "
                              f"of bits, got {bits!r}")
        if bits:
            return float(bits) + 0.25
    return None


def _mla(cfg: dict[str, Any], where: str) -> MLA | None:
    """DeepSeek's multi-head latent attention, when ``kv_lora_rank`` is set."""
    rank = _int(cfg, "kv_lora_rank", where)
    if not rank:
        return None
    return MLA(
        kv_lora_rank=rank,
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where) or 64,
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where) or 128,
        v_head_dim=_int(cfg, "v_head_dim", where) or 128,
        q_lora_rank=_int(cfg, "q_lora_rank", where),
    )


def _linear_state(cfg: dict[str, Any], where: str) -> int:
    """Elements of one linear-attention (gated delta net) state per request (0: none)."""
    if not _int(cfg, "linear_num_value_heads", where):
        return 0
    kh, vh, kd, vd = (_int(cfg, f"linear_{k}", where, low=1) for k in
                      ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    if None in (kh, kd, vd):
        raise ConfigError(f"{where}: linear attention needs linear_num_key_heads, "
                          "linear_key_head_dim and linear_value_head_dim")
    conv = (_int(cfg, "linear_conv_kernel_dim", where) or 4) - 1
    return vh * kd * vd + (2 * kh * kd + vh * vd) * conv


def _layers(cfg: dict[str, Any], n: int, kv_heads: int, head_dim: int, mla: MLA | None,
            where: str) -> list[LayerKV]:
    if mla is not None:
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        return [LayerKV(i, AttentionKind.MLA, 1, 0, latent_dim=latent) for i in range(n)]
    state = _linear_state(cfg, where)
    layers = []
    for i, (kind, window) in enumerate(_layer_kinds(cfg, n, where)):
        if kind in (AttentionKind.SLIDING, AttentionKind.CHUNKED) and not window:
            raise ConfigError(f"{where}: layer {i} is {kind.value} but no window size is set")
        layers.append(LayerKV(i, kind, kv_heads, head_dim, window=window,
                              state_elements=state if kind is AttentionKind.LINEAR else 0))
    return layers


def spec_from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Build a ModelSpec from a parsed HuggingFace config dict."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: config must be a JSON object")
    cfg = text_config(cfg)
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"{name}: config.json is missing {', '.join(missing)}")
    n = _positive_int(cfg, "num_hidden_layers", name)
    hidden = _positive_int(cfg, "hidden_size", name)
    heads = _positive_int(cfg, "num_attention_heads", name)
    vocab = _positive_int(cfg, "vocab_size", name)
    kv_heads = _int(cfg, "num_key_value_heads", name, heads, low=1)
    head_dim = _int(cfg, "head_dim", name, hidden // heads, low=1)
    if not head_dim:
        raise ConfigError(f"{name}: cannot determine head_dim")
    mla = _mla(cfg, name)

    layers = _layers(cfg, n, kv_heads, head_dim, mla, name)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    try:
        dtype = canonical_dtype(dtype)
    except ConfigError:
        dtype = "bfloat16"
    archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    return ModelSpec(
        name=name,
        architecture=str(archs[0]),
        model_type=str(cfg.get("model_type", "")),
        num_layers=n,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(cfg, "intermediate_size", name) or 4 * hidden,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype,
        max_position_embeddings=_int(cfg, "max_position_embeddings", name) or None,
        layers=tuple(layers),
        moe=_moe(cfg, name),
        mla=mla,
        total_params=_int(cfg, "total_params", name) or None,
        weight_bits=_weight_bits(cfg, name),
        hf_id=cfg.get("_name_or_path") or None,
        extra={"config": cfg},
    )


def read_config_file(path: Path) -> dict[str, Any]:
    raw = read_bounded(path, "config")
    try:
        return json.loads(raw)  # JSON is UTF-8 whatever the locale says
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (not UTF-8 text: byte "
                          f"0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None


def load_spec(source: str | Path) -> ModelSpec:
    """A ModelSpec from a config.json path, a model directory, or a catalog name/alias."""
    path = Path(source).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise ConfigError(f"{path}: directory has no config.json")
        return spec_from_config(read_config_file(cfg_path), name=path.name)
    if path.is_file():
        return spec_from_config(read_config_file(path), name=path.stem if path.stem != "config"
                                else path.parent.name or "model")
    from kvmem.spec.catalog import catalog_config

    entry_name, cfg = catalog_config(str(source))
    return spec_from_config(cfg, name=entry_name)
