"""Attention backends: write a step's new K/V into the paged cache, then attend over it.

>>> backend = get_attention_backend("reference")
>>> out = backend.forward(q, k, v, kv_cache, metadata, group_id, scale, sliding_window)

``kv_cache`` is one slot tensor ``[num_blocks, 2, block_size, kv_heads, head_dim]``.
"reference" (PyTorch SDPA over gathered blocks) runs anywhere; "triton" runs paged
attention kernels on a GPU; "auto" picks triton on CUDA when it is installed.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvmem.engine.attention.metadata import AttentionMetadata
from kvmem.errors import ConfigError

BACKENDS = ("auto", "reference", "triton")


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        ...


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_backend(name: str = "auto", device: str | torch.device | None = None
                          ) -> AttentionBackend:
    """The backend called ``name``; "auto" uses triton on CUDA devices, else the reference."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "auto":
        on_cuda = torch.device(device).type == "cuda" if device is not None \
            else torch.cuda.is_available()
        name = "triton" if on_cuda and triton_available() else "reference"
    if name == "triton":
        if not triton_available():
            raise ConfigError("attention backend 'triton' needs the triton package")
        from kvmem.engine.attention.triton_backend import TritonBackend

        return TritonBackend()
    from kvmem.engine.attention.reference import ReferenceBackend

    return ReferenceBackend()


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
