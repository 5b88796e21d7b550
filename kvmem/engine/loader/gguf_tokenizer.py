"""Build a byte-level BPE ``tokenizer.json`` (and chat template) from GGUF tokenizer metadata.

Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: Llama 3, Qwen, SmolLM).
The pre-tokenizer split rule is chosen from ``tokenizer.ggml.pre``, following the
families llama.cpp names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvmem.engine.loader.files import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str) -> dict[str, Any]:
    def split(pattern: str) -> list[dict[str, Any]]:
        return [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False},
        ]

    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        steps = [{"type": "Digits", "individual_digits": True},
                 {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}]
    elif pre in ("llama3", "llama-bpe", "smaug-bpe"):
        steps = split(_LLAMA3_SPLIT)
    elif pre == "qwen2":
        steps = split(_QWEN2_SPLIT)
    else:
        steps = split(_GPT2_SPLIT)
    return {"type": "Sequence", "pretokenizers": steps}


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> dict[str, Any] | None:
    """Prepend BOS to encoded text when the model asks for it (add_bos_token)."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token") or bos is None:
        return None
    token = tokens[int(bos)]
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": token, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": token, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {token: {"id": token, "ids": [int(bos)], "tokens": [token]}},
    }


def tokenizer_json(meta: dict[str, Any]) -> dict[str, Any]:
    """The tokenizers-library JSON for GGUF metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported (gpt2 BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] == _CONTROL}
        for i, tok in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default"))),
        "post_processor": _post_processor(meta, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (special tokens, chat template)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json(meta), ensure_ascii=False))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n")
