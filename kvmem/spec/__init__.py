"""Model configs -> per-layer KV layouts and weight sizes. Imports no torch.

>>> from kvmem.spec import load_spec
>>> spec = load_spec("Qwen/Qwen3-32B")
>>> spec.kv_bytes_per_token(dtype_bytes=1)  # fp8: 64 layers x 2,048 bytes
131072
"""

from kvmem.spec.catalog import CatalogEntry, catalog, find_entry
from kvmem.spec.config import load_spec, spec_from_config, text_config
from kvmem.spec.dtypes import KV_DTYPE_CHOICES, canonical_dtype, dtype_bytes, resolve_kv_dtype
from kvmem.spec.layout import MLA, AttentionKind, KVGroup, LayerKV, ModelSpec, MoE, build_kv_groups

__all__ = [
    "MLA", "AttentionKind", "CatalogEntry", "KVGroup", "KV_DTYPE_CHOICES", "LayerKV", "ModelSpec",
    "MoE", "build_kv_groups", "canonical_dtype", "catalog", "dtype_bytes", "find_entry",
    "load_spec", "resolve_kv_dtype", "spec_from_config", "text_config",
]
