"""vLLM's KV cache layouts built with torch alone, and a store/load round trip over them.

Shared by ``tests/test_vllm_connector_layouts.py``'s script in vLLM's venv (which checks
``build_views`` against vLLM's own allocation) and its CUDA test (which has no vLLM).
Imports no pytest and no vLLM.
"""

from __future__ import annotations

import math

import torch

ORDERS = {  # KVCacheLayout: logical [L, B, H, N, C] axis -> physical position
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


def build_views(order: tuple[int, ...], groups: list[tuple[list[str], int, int, int]],
                num_blocks: int, dtype: torch.dtype, device: str,
                kernel_split: int = 1) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views of one byte buffer, as vLLM lays them out for
    groups of ``(layer names, heads, tokens per block, content elements)`` with equal
    pages: every group from byte 0, its layers in ``order``."""
    size = max(len(names) * heads * tokens * content for names, heads, tokens, content in groups)
    raw = torch.zeros(size * num_blocks * torch.finfo(dtype).bits // 8, dtype=torch.uint8,
                      device=device)
    views = {}
    for names, heads, tokens, content in groups:
        shape = (len(names), num_blocks * kernel_split, heads, tokens // kernel_split, content)
        physical = [shape[axis] for axis in order]
        count = math.prod(shape)
        logical = raw.view(dtype)[:count].view(physical).permute(
            *[order.index(axis) for axis in range(5)])
        views.update((name, logical[i]) for i, name in enumerate(names))
    return views


class Holder:
    """Pool blocks kept while they are copied (vLLM's delayed free, here nothing to do)."""

    def hold(self, block_ids) -> None:
        pass

    def release(self, block_ids) -> None:
        pass


def round_trip(kv: dict[str, torch.Tensor], layout: object, offload: object) -> None:
    """Store blocks 1-3 (keys in group 0..), load them into 5-7; check every view."""
    gen = torch.Generator(device=next(iter(kv.values())).device).manual_seed(0)
    for view in kv.values():
        view.copy_(torch.randn(view.shape, generator=gen, device=view.device).to(view.dtype))
    before = {name: view.clone() for name, view in kv.items()}
    keys = [(b % len(layout.rules), bytes([b]) * 16) for b in (1, 2, 3)]
    offload.offer([1, 2, 3], keys)
    offload.drain()
    handle = offload.load("r", keys, [5, 6, 7])
    assert handle.done.wait(30) and handle.num_loaded == 3, handle.error
    for name, view in kv.items():
        rows = layout.block_rows(view)
        expected = layout.block_rows(before[name]).clone()
        expected[[5, 6, 7]] = expected[[1, 2, 3]]
        assert torch.equal(rows.contiguous().view(torch.uint8),
                           expected.contiguous().view(torch.uint8)), name
