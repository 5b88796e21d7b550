"""Read a HuggingFace ``config.json`` (dict, file, directory or catalog name) into a ModelSpec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.spec.dtypes import canonical_dtype
from kvmem.spec.layout import MLA, AttentionKind, LayerKV, ModelSpec, MoE

_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Gemma 3, Llama 4) keep the language model under ``text_config``."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(text)
        merged.setdefault("architectures", cfg.get("architectures"))
        return merged
    return cfg


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _layer_kinds(cfg: dict[str, Any], n: int, where: str) -> list[tuple[AttentionKind, int | None]]:
    """Each layer's attention kind and window, from whichever pattern field the family uses."""
    model_type = str(cfg.get("model_type", ""))
    window = cfg.get("sliding_window")
    sliding = (AttentionKind.SLIDING, window)
    full = (AttentionKind.FULL, None)

    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        if len(layer_types) != n:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {n} layers")
        chunk = cfg.get("attention_chunk_size")
        names = {
            "full_attention": full, "sliding_attention": sliding,
            "chunked_attention": (AttentionKind.CHUNKED, chunk),
            "linear_attention": (AttentionKind.LINEAR, None),
        }
        try:
            return [names[t] for t in layer_types]
        except KeyError as e:
            raise ConfigError(f"{where}: unknown layer type {e.args[0]!r} in layer_types") from None

    if cfg.get("full_attention_interval"):  # Qwen3-Next: linear attention, every n-th full
        step = int(cfg["full_attention_interval"])
        return [full if (i + 1) % step == 0 else (AttentionKind.LINEAR, None) for i in range(n)]

    if cfg.get("attention_chunk_size"):  # Llama 4: chunked layers, NoPE layers are global
        chunk = int(cfg["attention_chunk_size"])
        rope = cfg.get("no_rope_layers")
        if not isinstance(rope, list) or len(rope) != n:
            step = int(cfg.get("no_rope_layer_interval", 4))
            rope = [0 if (i + 1) % step == 0 else 1 for i in range(n)]
        return [(AttentionKind.CHUNKED, chunk) if r else full for r in rope]

    if model_type.startswith("gemma3") and window:
        step = int(cfg.get("sliding_window_pattern") or 6)
        return [full if (i + 1) % step == 0 else sliding for i in range(n)]
    if model_type == "gemma2" and window:
        return [sliding if i % 2 == 0 else full for i in range(n)]
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if cfg.get("use_sliding_window") and window:
            start = int(cfg.get("max_window_layers", n))
            return [sliding if i >= start else full for i in range(n)]
        return [full] * n
    if window and window < int(cfg.get("max_position_embeddings") or 1 << 62):
        return [sliding] * n  # Mistral v0.1, Phi-3: every layer slides
    return [full] * n


def _moe(cfg: dict[str, Any]) -> MoE | None:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not experts:
        return None
    per_tok = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1
    # Llama 4 calls its expert size intermediate_size (intermediate_size_mlp is the dense MLP)
    inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0
    return MoE(
        num_experts=int(experts), experts_per_token=int(per_tok),
        moe_intermediate_size=int(inter),
        num_shared_experts=int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts")
                               or (1 if cfg.get("shared_expert_intermediate_size") else 0)),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        interleave_step=int(cfg.get("interleave_moe_layer_step") or 1),
    )


def _weight_bits(cfg: dict[str, Any]) -> float | None:
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8" or "fp8" in str(quant.get("fmt", "")):
        return 8.0
    if method == "mxfp4":
        return 4.25
    bits = quant.get("bits") or quant.get("w_bit")
    return float(bits) + 0.25 if bits else None


def spec_from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Build a ModelSpec from a parsed HuggingFace config dict."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: config must be a JSON object")
    cfg = _text_config(cfg)
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"{name}: config.json is missing {', '.join(missing)}")
    n = _positive_int(cfg, "num_hidden_layers", name)
    hidden = _positive_int(cfg, "hidden_size", name)
    heads = _positive_int(cfg, "num_attention_heads", name)
    vocab = _positive_int(cfg, "vocab_size", name)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ConfigError(f"{name}: field 'num_key_value_heads' must be a positive integer")
    head_dim = cfg.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"{name}: cannot determine head_dim")

    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLA(
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 64),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 128),
            v_head_dim=int(cfg.get("v_head_dim") or 128),
            q_lora_rank=cfg.get("q_lora_rank"),
        )

    layers: list[LayerKV] = []
    if mla is not None:
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        layers = [LayerKV(i, AttentionKind.MLA, 1, 0, latent_dim=latent) for i in range(n)]
    else:
        state = 0
        if cfg.get("linear_num_value_heads"):
            kh, vh = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
            kd, vd = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
            conv = int(cfg.get("linear_conv_kernel_dim") or 4) - 1
            state = vh * kd * vd + (2 * kh * kd + vh * vd) * conv
        for i, (kind, window) in enumerate(_layer_kinds(cfg, n, name)):
            if kind in (AttentionKind.SLIDING, AttentionKind.CHUNKED) and not window:
                raise ConfigError(f"{name}: layer {i} is {kind.value} but no window size is set")
            layers.append(LayerKV(i, kind, kv_heads, head_dim, window=window,
                                  state_elements=state if kind is AttentionKind.LINEAR else 0))

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
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        layers=tuple(layers),
        moe=_moe(cfg),
        mla=mla,
        total_params=cfg.get("total_params"),
        weight_bits=_weight_bits(cfg),
        hf_id=cfg.get("_name_or_path") or None,
        extra={"config": cfg},
    )


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
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
