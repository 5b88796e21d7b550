"""Model construction: a HuggingFace config dict -> a paged-cache decoder module.

>>> model = build_model(config, dtype=torch.float32, device="cpu")
>>> model.load_weights(files.weights())
>>> hidden = model(input_ids, positions, metadata, kv_caches)
>>> logits = model.compute_logits(hidden[last_token_rows])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvmem.engine.attention import get_attention_backend
from kvmem.errors import ConfigError
from kvmem.spec import text_config

# architecture -> decoder: the Llama family's (models/llama.py, differing by LlamaVariant)
# or Gemma 3's text decoder (models/gemma3.py; of a multimodal checkpoint, its language model)
# or the Gated DeltaNet hybrids Qwen3-Next and Qwen3.5 (models/qwen3_next.py)
DECODERS = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_next",
}
SUPPORTED_ARCHITECTURES = tuple(DECODERS)


def model_architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else {
        "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
        "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
    }.get(str(config.get("model_type")), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"model architecture {arch or config.get('model_type')!r} is not "
                          f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def build_model(config: dict[str, Any], *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", tp_rank: int = 0, tp_size: int = 1,
                layers: range | None = None, attention_backend: str = "auto") -> nn.Module:
    """An uninitialised model for ``config`` (call ``load_weights`` next).

    ``layers`` restricts the decoder layers to one pipeline stage's range.
    """
    from kvmem.engine.models.gemma3 import Gemma3ForCausalLM
    from kvmem.engine.models.llama import LlamaForCausalLM
    from kvmem.engine.models.qwen3_next import Qwen3NextForCausalLM

    arch = model_architecture(config)
    text = text_config(config)
    n = int(text.get("num_hidden_layers", 0))
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        # grouped-query attention: every query head reads one KV head, as many per KV head
        raise ConfigError(f"num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if layers is not None and (layers.step != 1 or not 0 <= layers.start < layers.stop <= n):
        raise ConfigError(f"layer range {layers} is not a contiguous part of {n} layers")
    backend = get_attention_backend(attention_backend, device)
    decoder = {"llama": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM,
               "qwen3_next": Qwen3NextForCausalLM}[DECODERS[arch]]
    with torch.device(device):
        model = decoder(config, backend, architecture=arch, tp_rank=tp_rank, tp_size=tp_size,
                        layers=layers)
    return model.to(dtype=dtype).eval()


__all__ = ["SUPPORTED_ARCHITECTURES", "build_model", "model_architecture"]
