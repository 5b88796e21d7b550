"""Tiny random-weight checkpoints for tests, built locally with transformers (no download).

``make_tiny_checkpoint(tmp_path, family)`` writes config.json, model.safetensors,
tokenizer.json and tokenizer_config.json (byte-level tokenizer, ChatML template) and
returns the directory. The same seed gives the same weights.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_BASE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1,
    "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 256,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "tie_word_embeddings": False},
    # layer 0 full attention, layer 1 sliding window of 8 tokens: two KV groups
    "qwen2": {"rope_theta": 1000000.0, "use_sliding_window": True, "sliding_window": 8,
              "max_window_layers": 1, "tie_word_embeddings": False},
    # explicit head_dim larger than hidden/heads, q/k norm, tied embeddings
    "qwen3": {"rope_theta": 1000000.0, "head_dim": 32, "tie_word_embeddings": True},
    # every layer slides over 8 tokens
    "mistral": {"rope_theta": 10000.0, "sliding_window": 8, "tie_word_embeddings": False},
}


def byte_level_tokenizer_json() -> dict[str, Any]:
    """A byte-level tokenizer with the 256 byte symbols and no merges, plus special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return json.loads(tok.to_str())


def make_tiny_checkpoint(tmp_path: Path, family: str = "llama", seed: int = 0,
                         **overrides: Any) -> Path:
    """Write a random tiny ``family`` ("llama", "qwen2", "qwen3", "mistral") checkpoint."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    config = config_cls(**{**_BASE, **FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    out = Path(tmp_path) / f"tiny-{family}"
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


@functools.lru_cache(maxsize=1)
def embedded_files():
    """The embedded SmolLM2 checkpoint (converted once into the kvmem cache directory)."""
    from kvmem.engine.loader import resolve_model

    return resolve_model(None)


_GEMMA3 = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320, "max_position_embeddings": 4096,
    "sliding_window": 128, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 256, "rope_theta": 10000.0,
    "rope_local_base_freq": 10000.0,
}


def _write_tokenizer(out: Path) -> None:
    (out / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
    }))


def _randomize_norms(model, seed: int) -> None:
    """Gemma's norms start at a gain of exactly one (weight 0); trained ones do not."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "vision" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def make_tiny_gemma3(tmp_path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random tiny Gemma-3 text checkpoint (``Gemma3ForCausalLM``): by default 5
    sliding-window layers (window 128) and one full-attention layer, as vLLM runs it with
    its hybrid KV cache manager (6 KV cache groups of one layer each). ``overrides`` are
    ``Gemma3TextConfig`` fields."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(**{**_GEMMA3, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    _randomize_norms(model, seed)
    out = Path(tmp_path) / "tiny-gemma3"
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


# What gemma-3-4b-it's config.json names of its language model: the rest is
# Gemma3TextConfig's defaults (heads, head_dim, vocabulary, RoPE bases, every 6th layer global)
GEMMA3_4B_TEXT_FIELDS = ("hidden_size", "intermediate_size", "model_type", "num_hidden_layers",
                         "rope_scaling", "sliding_window")


def make_tiny_gemma3_multimodal(tmp_path: Path, seed: int = 0, *, names: str = "transformers5",
                                **text_overrides: Any) -> Path:
    """A random tiny ``Gemma3ForConditionalGeneration`` checkpoint: the text decoder under
    ``text_config`` beside a one-layer SigLIP vision tower and the projector.

    ``names`` picks how the checkpoint is laid out:
    - "transformers5": as transformers 5 saves it (``language_model.model.*`` weights,
      every text field written out, RoPE as ``rope_parameters`` per layer type);
    - "transformers4.52": weights named ``model.language_model.*``, ``model.vision_tower.*``
      (transformers 4.52 to 4.57);
    - "gemma-3-4b-it": ``language_model.model.*`` weights, and a text_config naming only
      what gemma-3-4b-it's does (``GEMMA3_4B_TEXT_FIELDS``, plus the head and vocabulary
      sizes that make it tiny), RoPE as ``rope_scaling``: the text model must then be built
      with Gemma3TextConfig's defaults for the rest.
    """
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    tiny_text = {**_GEMMA3, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 16, **text_overrides}
    if names == "gemma-3-4b-it":  # the fields its config leaves out take their defaults
        for field in ("layer_types", "rope_theta", "rope_local_base_freq",
                      "max_position_embeddings"):
            tiny_text.pop(field, None)
    text = transformers.Gemma3TextConfig(**tiny_text)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, eos_token_id=[258, 106])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    _randomize_norms(model, seed)
    out = Path(tmp_path) / f"tiny-gemma3-mm-{names}"
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    if names == "transformers4.52":
        weights = out / "model.safetensors"
        renamed = {_name_4_52(name): t for name, t in load_file(str(weights)).items()}
        save_file(renamed, str(weights), metadata={"format": "pt"})
    elif names == "gemma-3-4b-it":
        saved = json.loads((out / "config.json").read_text())
        text_fields = (*GEMMA3_4B_TEXT_FIELDS, "vocab_size", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "bos_token_id", "eos_token_id",
                       "pad_token_id")
        saved["text_config"] = {k: v for k, v in saved["text_config"].items() if k in text_fields}
        rope = text.rope_parameters["full_attention"]
        if rope["rope_type"] != "default":
            saved["text_config"]["rope_scaling"] = {k: v for k, v in rope.items()
                                                    if k != "rope_theta"}
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    elif names != "transformers5":
        raise ValueError(f"unknown checkpoint names {names!r}")
    return out


def _name_4_52(name: str) -> str:
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return "model." + name  # vision_tower.*, multi_modal_projector.*


@functools.lru_cache(maxsize=1)
def transformers_gguf_reference():
    """(HF config, state dict, model) of the embedded GGUF, read by transformers' own GGUF
    loader: an independent dequantisation and q/k un-permutation to compare against."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvmem.engine.loader.gguf_convert import embedded_gguf

    parsed = load_gguf_checkpoint(str(embedded_gguf()), return_tensors=False)
    config = LlamaConfig(**parsed["config"])
    model = LlamaForCausalLM(config).float().eval()
    tensors = load_gguf_checkpoint(str(embedded_gguf()), return_tensors=True,
                                   model_to_load=model)["tensors"]
    tensors = {name: t.float() for name, t in tensors.items()}
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
    return config, tensors, model


# fields a catalog entry leaves out that the engine's model reads (the published values)
_SHAPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643,
              "eos_token_id": 151645},
}


def make_shaped_checkpoint(tmp_path: Path, name: str, **overrides: Any) -> Path:
    """A directory with a real model's config (from kvmem's catalog, e.g. "Qwen3-0.6B") and
    the byte-level tokenizer, no weights: for ``load_format="dummy"`` (random weights of
    the real shape)."""
    from kvmem.spec import find_entry

    config = dict(find_entry(name).config)
    config = {**_SHAPE_DEFAULTS.get(str(config.get("model_type")), {}), **config, **overrides}
    return make_config_checkpoint(tmp_path, f"{name}-config-only", config)


def make_config_checkpoint(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    """A directory with ``config`` and the byte-level tokenizer, no weights: for
    ``load_format="dummy"`` (random weights of the config's shape), e.g. a tiny Mamba
    hybrid transformers cannot build here."""
    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
    }))
    return out


TINY_NEMOTRON_PATTERN = "M-M*M-M*M-M*"


def tiny_qwen3_next(n: int, dtype: str) -> dict:
    """A tiny Qwen3-Next: every fourth layer full attention, the rest Gated DeltaNet."""
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "hidden_size": 64, "num_hidden_layers": n, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
            "vocab_size": 320, "max_position_embeddings": 8192, "full_attention_interval": 4,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "torch_dtype": dtype, "tie_word_embeddings": False}


def make_tiny_qwen3_next(tmp_path: Path, n: int, seed: int = 0, **overrides: Any) -> Path:
    """A random fp32 tiny Qwen3-Next (``tiny_qwen3_next``, then ``overrides``) from
    transformers, with the byte-level tokenizer."""
    import torch
    import transformers

    fields = {k: v for k, v in {**tiny_qwen3_next(n, "float32"), **overrides}.items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **fields, initializer_range=0.1)).float().eval()
    _randomize_norms(model, seed + 1)
    out = Path(tmp_path) / "tiny-qwen3_next"
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


def tiny_nemotron_h(dtype: str, n_groups: int) -> dict:
    """A tiny Nemotron-H: Mamba2 (M), MLP (-) and attention (*) layers."""
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "hidden_size": 64, "num_hidden_layers": len(TINY_NEMOTRON_PATTERN),
            "hybrid_override_pattern": TINY_NEMOTRON_PATTERN, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
            "vocab_size": 320, "max_position_embeddings": 8192, "mamba_num_heads": 4,
            "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": n_groups,
            "conv_kernel": 4, "mlp_hidden_act": "relu2", "torch_dtype": dtype,
            "tie_word_embeddings": False}


def tiny_kimi_linear(dtype: str, heads: int) -> dict:
    """A tiny Kimi Linear: KDA layers (1-based 1-3 and 5) and MLA layers 4 and 6."""
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 320,
            "max_position_embeddings": 8192, "kv_lora_rank": 32, "q_lora_rank": None,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "torch_dtype": dtype,
            "linear_attn_config": {"full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5],
                                   "num_heads": heads, "head_dim": 16,
                                   "short_conv_kernel_size": 4}}


def tiny_lfm2(dtype: str) -> dict:
    """A tiny LFM2: short-convolution layers and, every third layer, full attention."""
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "layer_types": ["full_attention" if (i + 1) % 3 == 0 else "conv"
                            for i in range(6)],
            "conv_L_cache": 3, "conv_dim": 128, "intermediate_size": 256,
            "block_ff_dim": 256, "vocab_size": 320, "max_position_embeddings": 8192,
            "torch_dtype": dtype, "tie_word_embeddings": True}
