"""Speculative decoding's KV: vLLM's ``--speculative-config`` read into the draft's layers.

vLLM (``vllm/config/speculative.py``, 0.32 and 0.33) builds the drafter's attention layers
beside the target's, and they join the KV cache config like any other layer:

- ``mtp``: the target's own multi-token-prediction modules, ``num_nextn_predict_layers`` of
  them, each a decoder layer of the target's shape (DeepSeek's: latent attention, with
  V3.2's indexer); ``num_speculative_tokens`` defaults to that count.
- ``eagle``, ``eagle3``, ``draft_model``: a separate small model (``model``) with layers of
  its own shape.
- ``ngram``, ``suffix``: no draft model, no KV.

Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from kvmem.errors import ConfigError
from kvmem.spec.layout import AttentionKind, LayerKV, ModelSpec, Speculative

FLAG = "--speculative-config"
MTP = "mtp"
DRAFT_MODELS = ("eagle", "eagle3", "draft_model")
NO_DRAFT = ("ngram", "ngram_gpu", "suffix")
METHODS = (MTP, *DRAFT_MODELS, *NO_DRAFT)


def parse_speculative_config(text: str) -> dict[str, Any]:
    """The flag's JSON object, as ``vllm serve --speculative-config`` takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{FLAG}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{FLAG}: must be a JSON object, e.g. "
                          '{"method": "mtp", "num_speculative_tokens": 1}')
    return value


def speculative_spec(spec: ModelSpec, text: str) -> ModelSpec:
    """``spec`` with the draft that vLLM's ``--speculative-config`` ``text`` describes; an
    EAGLE or draft model named by ``model`` is read as any MODEL is (``load_spec``)."""
    config = parse_speculative_config(text)
    draft = config.get("model")
    if draft is not None and _method(config) != MTP:
        _tokens(config, None)  # before the draft is read
        if not isinstance(draft, str) or not draft:
            raise ConfigError(f"{FLAG}: field 'model' must be a model name or path, "
                              f"got {draft!r}")
        from kvmem.spec.config import load_spec

        return with_speculative(spec, config, load_spec(draft))
    return with_speculative(spec, config)


def _method(config: dict[str, Any]) -> str:
    method = config.get("method")
    if method not in METHODS:
        raise ConfigError(f"{FLAG}: field 'method' must be one of {', '.join(METHODS)}, "
                          f"got {method!r}")
    return method


def _tokens(config: dict[str, Any], default: int | None) -> int:
    k = config.get("num_speculative_tokens", default)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{FLAG}: field 'num_speculative_tokens' must be a positive "
                          f"integer, got {k!r}")
    return k


def _mtp_layers(spec: ModelSpec) -> tuple[int, tuple[LayerKV, ...]]:
    """The target's MTP modules: each a decoder layer shaped like its last global one."""
    cfg = spec.extra.get("config", {})
    n = cfg.get("num_nextn_predict_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{FLAG}: method 'mtp' needs a model with MTP layers "
                          f"({spec.name} has no num_nextn_predict_layers)")
    shape = next((lay for lay in reversed(spec.layers) if lay.has_own_cache
                  and lay.kind in (AttentionKind.FULL, AttentionKind.MLA)), None)
    if shape is None:
        raise ConfigError(f"{FLAG}: {spec.name} has no full-attention layer for its MTP "
                          "modules to take the shape of")
    # an MTP layer of a sparse MLA model always builds its indexer (DeepseekV2Attention)
    index_bytes = max(lay.index_bytes for lay in spec.layers)
    return n, tuple(replace(shape, index=spec.num_layers + i, index_bytes=index_bytes)
                    for i in range(n))


def with_speculative(spec: ModelSpec, config: dict[str, Any],
                     draft: ModelSpec | None = None) -> ModelSpec:
    """``spec`` with the draft layers and speculative tokens of ``config`` (vLLM's
    ``--speculative-config``); ``draft`` is the EAGLE or draft model (its ``model``)."""
    method = _method(config)
    if method == MTP:
        n, layers = _mtp_layers(spec)
        return replace(spec, speculative=Speculative(method, _tokens(config, n), layers, n))
    k = _tokens(config, None)
    if method in NO_DRAFT:
        return replace(spec, speculative=Speculative(method, k))
    if draft is None:
        raise ConfigError(f"{FLAG}: method {method!r} needs field 'model' (the draft model)")
    layers = tuple(replace(lay, index=spec.num_layers + lay.index,
                           kv_source=None if lay.kv_source is None
                           else spec.num_layers + lay.kv_source)
                   for lay in draft.layers)
    return replace(spec, speculative=Speculative(method, k, layers))
