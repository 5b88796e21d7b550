"""KV-cache and weight dtypes: names users type, and their sizes in bytes."""

from __future__ import annotations

from kvmem.errors import ConfigError

# Canonical name -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

_ALIASES = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}

KV_DTYPE_CHOICES = ("auto", "fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")


def canonical_dtype(name: str) -> str:
    """Map a dtype name (``bf16``, ``torch.float16``, ``fp8``...) to its canonical name."""
    key = str(name).lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(KV_DTYPE_CHOICES)}")
    return _ALIASES[key]


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV dtype actually stored: ``auto`` follows the model's dtype."""
    if kv_cache_dtype == "auto":
        return canonical_dtype(model_dtype)
    return canonical_dtype(kv_cache_dtype)


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[canonical_dtype(name)]
