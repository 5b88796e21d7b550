"""Read a HuggingFace ``config.json`` (dict, file, directory or catalog name) into a ModelSpec."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.files import read_bounded
from kvmem.spec.bounds import check_bounds
from kvmem.spec.dtypes import canonical_dtype
from kvmem.spec.layout import (
    MLA,
    AttentionKind,
    LayerKV,
    LinearState,
    ModelSpec,
    MoE,
    StateKind,
)

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


# Nemotron-H's hybrid_override_pattern: one character a layer
_PATTERN_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _hybrid_layer_types(cfg: dict[str, Any], n: int, where: str) -> list[str] | None:
    """The layer types of a Mamba hybrid that does not list ``layer_types``: Nemotron-H's
    ``hybrid_override_pattern`` or ``layers_block_type``, Bamba's ``attn_layer_indices``."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        unknown = set(pattern) - set(_PATTERN_TYPES)
        if unknown:
            raise ConfigError(f"{where}: unknown layer {sorted(unknown)[0]!r} in "
                              "hybrid_override_pattern")
        return [_PATTERN_TYPES[c] for c in pattern]
    blocks = cfg.get("layers_block_type")
    if isinstance(blocks, list):
        return [str(b) for b in blocks]
    attn = cfg.get("attn_layer_indices")
    if isinstance(attn, list) and cfg.get("mamba_n_heads"):
        return ["attention" if i in attn else "mamba" for i in range(n)]
    return None


def _layer_kinds(cfg: dict[str, Any], n: int, where: str) -> list[tuple[AttentionKind, int | None]]:
    """Each layer's attention kind and window, from whichever pattern field the family uses."""
    model_type = str(cfg.get("model_type", ""))
    window = _window(cfg, where, _slides(cfg))
    chunk = _int(cfg, "attention_chunk_size", where)
    sliding = (AttentionKind.SLIDING, window)
    full = (AttentionKind.FULL, None)

    layer_types = cfg.get("layer_types")
    if not isinstance(layer_types, list):
        layer_types = _hybrid_layer_types(cfg, n, where)
    if isinstance(layer_types, list):
        if len(layer_types) != n:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {n} layers")
        names = {
            "full_attention": full, "sliding_attention": sliding,
            "chunked_attention": (AttentionKind.CHUNKED, chunk),
            "linear_attention": (AttentionKind.LINEAR, None),
            # Granite-4.0-H, LFM2, Nemotron-H (layers_block_type)
            "attention": full, "mamba": (AttentionKind.LINEAR, None),
            "conv": (AttentionKind.LINEAR, None),
            "mlp": (AttentionKind.NONE, None), "moe": (AttentionKind.NONE, None),
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
    if not shared and _first_int(cfg, ("shared_expert_intermediate_size",
                                       "shared_intermediate_size"), where):
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


def _need(cfg: dict[str, Any], keys: tuple[str, ...], where: str, what: str) -> list[int]:
    """Positive integer fields a state needs, in order; one line naming those missing."""
    values = [_int(cfg, k, where, low=1) for k in keys]
    missing = [k for k, v in zip(keys, values, strict=True) if v is None]
    if missing:
        raise ConfigError(f"{where}: {what} needs {', '.join(missing)}")
    return values


def _linear_state(cfg: dict[str, Any], where: str) -> LinearState | None:
    """The per-request state of the model's linear-attention layers, with the fields vLLM's
    model classes read (``get_mamba_state_shape_from_config``); None: no such layers."""
    if _int(cfg, "linear_num_value_heads", where):  # Gated DeltaNet: Qwen3-Next, Qwen3.5
        kh, vh, kd, vd = _need(cfg, tuple(f"linear_{k}" for k in (
            "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")),
            where, "Gated DeltaNet linear attention")
        kernel = _int(cfg, "linear_conv_kernel_dim", where, 4, low=1)
        # Qwen3.5's config class (vLLM's, not Qwen3-Next's) takes its mamba_ssm_dtype
        qwen35 = str(cfg.get("model_type", "")).startswith("qwen3_5")
        return LinearState(StateKind.GATED_DELTA_NET, 2 * kh * kd + vh * vd, kernel - 1,
                           (vh, vd, kd), ssm_dtype=_dtype_name(cfg.get("mamba_ssm_dtype"))
                           if qwen35 else None)
    if _int(cfg, "mamba_num_heads", where):  # Nemotron-H
        heads, head_dim, state, groups, kernel = _need(cfg, (
            "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
            where, "Mamba2")
        return _mamba2(heads * head_dim, heads, head_dim, state, groups, kernel,
                       _dtype_name(cfg.get("mamba_ssm_cache_dtype")) or "float32")
    if _int(cfg, "mamba_n_heads", where):  # Granite-4.0-H, Bamba
        heads, head_dim, state, groups, kernel, expand = _need(cfg, (
            "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
            "mamba_d_conv", "mamba_expand"), where, "Mamba2")
        return _mamba2(expand * _positive_int(cfg, "hidden_size", where), heads, head_dim,
                       state, groups, kernel, None)
    if isinstance(cfg.get("linear_attn_config"), dict):  # Kimi Delta Attention
        kda = cfg["linear_attn_config"]
        heads, head_dim, kernel = _need(kda, ("num_heads", "head_dim", "short_conv_kernel_size"),
                                        where, "Kimi Delta Attention (linear_attn_config)")
        # q, k and v through the short convolution; the recurrent state is float32 unless
        # mamba_ssm_cache_dtype says bfloat16 (MambaStateDtypeCalculator.kda_state_dtype)
        return LinearState(StateKind.KDA, 3 * heads * head_dim, kernel - 1,
                           (heads, head_dim, head_dim), ssm_dtype="float32",
                           bounded_gate=kda.get("gate_lower_bound") is not None)
    if str(cfg.get("model_type", "")).startswith("lfm2"):  # LFM2's short convolutions
        kernel = _int(cfg, "conv_L_cache", where, 3, low=1)
        channels = _int(cfg, "conv_dim", where, low=1) or _positive_int(cfg, "hidden_size", where)
        return LinearState(StateKind.SHORT_CONV, channels, kernel - 1)
    return None


def _mamba2(inner: int, heads: int, head_dim: int, state: int, groups: int, kernel: int,
            ssm_dtype: str | None) -> LinearState:
    return LinearState(StateKind.MAMBA2, inner + 2 * groups * state, kernel - 1,
                       (heads, head_dim, state), n_groups=groups, state_size=state,
                       ssm_dtype=ssm_dtype)


def _dtype_name(value: Any) -> str | None:
    """A dtype a config names for a state (None when absent or "auto")."""
    if value in (None, "auto"):
        return None
    try:
        return canonical_dtype(str(value))
    except ConfigError:
        return None


def _indexers(cfg: dict[str, Any], n: int, where: str) -> list[int]:
    """Each layer's indexer key cache, bytes per token (DeepSeek V3.2's sparse attention,
    ``index_topk`` set; vLLM's ``DeepseekV32IndexerCache``): ``index_head_dim`` fp8 values
    and a float32 scale per 128 of them. ``index_topk_pattern`` ("S": skip) or every
    ``index_topk_freq``-th layer from ``index_skip_topk_offset`` keep one; none: all."""
    dim = _int(cfg, "index_head_dim", where, 128, low=1)
    bytes_per_token = dim + dim // 128 * 4
    pattern = cfg.get("index_topk_pattern")
    if isinstance(pattern, (list, str)):
        return [0 if i < len(pattern) and pattern[i] == "S" else bytes_per_token
                for i in range(n)]
    freq = _int(cfg, "index_topk_freq", where, 1, low=1)
    offset = _int(cfg, "index_skip_topk_offset", where, 2, low=None)
    return [0 if max(i - offset + 1, 0) % freq else bytes_per_token for i in range(n)]


def _kv_sources(cfg: dict[str, Any], kinds: list[tuple[AttentionKind, int | None]],
                where: str) -> list[int | None]:
    """The layer each of the last ``num_kv_shared_layers`` reads its KV from (Gemma 3n,
    Gemma 4; vLLM's ``kv_sharing_target_layer_name``): the last earlier layer of its
    attention kind (Gemma 3n: the layer one before the shared ones, or two for sliding)."""
    shared = _int(cfg, "num_kv_shared_layers", where, 0)
    first = len(kinds) - shared
    if not shared:
        return [None] * len(kinds)
    if first < 2:
        raise ConfigError(f"{where}: field 'num_kv_shared_layers' must leave two layers "
                          f"of their own, got {shared} of {len(kinds)}")
    sources: list[int | None] = [None] * first
    for i in range(first, len(kinds)):
        if str(cfg.get("model_type", "")).startswith("gemma3n"):
            sources.append(first - (2 if kinds[i][0] is AttentionKind.SLIDING else 1))
            continue
        same = [j for j in range(first) if kinds[j][0] is kinds[i][0]]
        if not same:
            raise ConfigError(f"{where}: shared layer {i} ({kinds[i][0].value}) has no "
                              "earlier layer of its kind to read")
        sources.append(same[-1])
    return sources


def _kda_layers(cfg: dict[str, Any], n: int, mla: MLA | None,
                where: str) -> list[LayerKV] | None:
    """Kimi Linear's layers: ``linear_attn_config.kda_layers`` (1-based) keep a Kimi Delta
    Attention state, the others (``full_attn_layers``) are MLA (vLLM's ``is_kda_layer``)."""
    kda = cfg.get("linear_attn_config")
    if not isinstance(kda, dict):
        return None
    listed = kda.get("kda_layers")
    if listed is None:  # the released config lists both; vLLM's config class needs both
        full = kda.get("full_attn_layers")
        listed = [i + 1 for i in range(n) if isinstance(full, list) and i + 1 not in full]
    if not isinstance(listed, list) or not all(isinstance(i, int) for i in listed):
        raise ConfigError(f"{where}: field 'linear_attn_config.kda_layers' must be a list "
                          f"of layer numbers, got {listed!r}")
    if mla is None:
        raise ConfigError(f"{where}: Kimi Delta Attention's full layers need kv_lora_rank "
                          "(MLA)")
    state = _linear_state(cfg, where)
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    return [LayerKV(i, AttentionKind.LINEAR, state=state) if i + 1 in listed
            else LayerKV(i, AttentionKind.MLA, 1, 0, latent_dim=latent) for i in range(n)]


def _layers(cfg: dict[str, Any], n: int, kv_heads: int, head_dim: int, mla: MLA | None,
            where: str) -> list[LayerKV]:
    if (kimi := _kda_layers(cfg, n, mla, where)) is not None:
        return kimi
    if mla is not None:
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        if "index_topk" not in cfg:
            return [LayerKV(i, AttentionKind.MLA, 1, 0, latent_dim=latent) for i in range(n)]
        return [LayerKV(i, AttentionKind.MLA, 1, 0, latent_dim=latent, sparse=True,
                        index_bytes=b) for i, b in enumerate(_indexers(cfg, n, where))]
    state = _linear_state(cfg, where)
    layers = []
    kinds = _layer_kinds(cfg, n, where)
    for i, ((kind, window), source) in enumerate(zip(kinds, _kv_sources(cfg, kinds, where),
                                                     strict=True)):
        if kind in (AttentionKind.SLIDING, AttentionKind.CHUNKED) and not window:
            raise ConfigError(f"{where}: layer {i} is {kind.value} but no window size is set")
        heads, dim = _layer_shape(cfg, i, kind, kv_heads, head_dim, where)
        layers.append(LayerKV(i, kind, heads, dim, window=window,
                              state=state if kind is AttentionKind.LINEAR else None,
                              kv_source=source))
    return layers


def _layer_shape(cfg: dict[str, Any], i: int, kind: AttentionKind, kv_heads: int,
                 head_dim: int, where: str) -> tuple[int, int]:
    """Layer i's KV heads and head size: Gemma 4's ``per_layer_config`` (keyed by the
    layer's index, "05") overrides the model's for its full-attention layers. A config.json
    as published holds the fields transformers builds it from instead: ``global_head_dim``
    (512 when absent) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None and str(cfg.get("model_type", "")).startswith("gemma4"):
        if kind is not AttentionKind.FULL:
            return kv_heads, head_dim
        heads = (_int(cfg, "num_global_key_value_heads", where, kv_heads, low=1)
                 if cfg.get("attention_k_eq_v") is True else kv_heads)
        return heads, _int(cfg, "global_head_dim", where, 512, low=1)
    if not isinstance(per_layer, dict):
        return kv_heads, head_dim
    own = next((v for k, v in per_layer.items() if str(k).isdigit() and int(k) == i), None)
    if not isinstance(own, dict):
        return kv_heads, head_dim
    return (_int(own, "num_key_value_heads", where, kv_heads, low=1),
            _int(own, "head_dim", where, head_dim, low=1))


def spec_from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Build a ModelSpec from a parsed HuggingFace config dict."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: config must be a JSON object")
    cfg = text_config(cfg)
    check_bounds(cfg, name)
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
    if not isinstance(archs, (list, str)):
        raise ConfigError(f"{name}: field 'architectures' must be a list of class names, "
                          f"got {archs!r}")
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
    """A ModelSpec from a config.json path, a model directory, a catalog name/alias, or a
    Hugging Face Hub repo id (kvmem.spec.hub)."""
    path = Path(source).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise ConfigError(f"{path}: directory has no config.json")
        return spec_from_config(read_config_file(cfg_path), name=path.name)
    if path.is_file():
        return spec_from_config(read_config_file(path), name=path.stem if path.stem != "config"
                                else path.parent.name or "model")
    from kvmem.spec.catalog import named_spec

    return named_spec(str(source))  # the catalog's, else the Hugging Face Hub's
