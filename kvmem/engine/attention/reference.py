"""Reference attention: gather a sequence's blocks into contiguous K/V and call SDPA.

Simple and exact; runs on CPU and GPU. Decode-only batches take one batched SDPA call
over ``[B, max_context]`` with a padding mask; batches with prefill chunks loop over
their sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmem.engine.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's k/v at its slot; slots of -1 are skipped.

    Skipped tokens rewrite slot 0's current value onto itself instead of being filtered
    out, so that no step reads a device value back to the host (CUDA-graph safe).
    """
    block_size = kv_cache.shape[2]
    keep = (slot_mapping >= 0).view(-1, 1, 1)
    slots = slot_mapping.clamp(min=0)
    blocks, offsets = slots // block_size, slots % block_size
    for i, new in ((0, k), (1, v)):
        old = kv_cache[blocks, i, offsets]
        kv_cache[blocks, i, offsets] = torch.where(keep, new.to(kv_cache.dtype), old)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[..., num_tokens, Hkv, D]`` of the blocks in ``block_table`` (``[..., n]``)."""
    block_size = kv_cache.shape[2]
    n = -(-num_tokens // block_size)
    blocks = kv_cache[block_table[..., :n].long()]  # [..., n, 2, bs, H, D]
    blocks = blocks.movedim(-4, -5)  # [..., 2, n, bs, H, D]
    kv = blocks.flatten(-4, -3)[..., :num_tokens, :, :]
    return kv.select(-4, 0), kv.select(-4, 1)


def attention_mask(query_pos: torch.Tensor, key_len: int, sliding_window: int | None
                   ) -> torch.Tensor:
    """Boolean mask ``[..., q, key_len]``: key j is visible to a query at position p iff
    ``j <= p`` and, with a window W, ``j > p - W``."""
    keys = torch.arange(key_len, device=query_pos.device)
    p = query_pos.unsqueeze(-1)
    mask = keys <= p
    if sliding_window is not None:
        mask &= keys > p - sliding_window
    return mask


class ReferenceBackend:
    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mappings[group_id])
        block_table = metadata.block_tables[group_id]
        if metadata.is_decode_only:
            return self._decode(q, kv_cache, metadata, block_table, scale, sliding_window)
        out = torch.empty_like(q)
        start = 0
        lens = zip(metadata.query_lens, metadata.seq_lens_cpu, strict=True)
        for b, (q_len, seq_len) in enumerate(lens):
            if q_len == 0:
                continue
            keys, values = gather_kv(kv_cache, block_table[b], seq_len)
            pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = attention_mask(pos, seq_len, sliding_window)
            out[start:start + q_len] = _sdpa(q[start:start + q_len].transpose(0, 1),
                                             keys.transpose(0, 1), values.transpose(0, 1),
                                             mask, scale).transpose(0, 1)
            start += q_len
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                block_table: torch.Tensor, scale: float, sliding_window: int | None
                ) -> torch.Tensor:
        keys, values = gather_kv(kv_cache, block_table, metadata.max_seq_len)  # [B, L, H, D]
        pos = (metadata.seq_lens.to(q.device).long() - 1).unsqueeze(-1)  # [B, 1]
        mask = attention_mask(pos, metadata.max_seq_len, sliding_window)  # [B, 1, L]
        out = _sdpa(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                    mask.unsqueeze(1), scale)  # [B, Hq, 1, D]
        return out.squeeze(2)


# SDPA shares K/V heads between query heads itself since torch 2.5 (no copies)
_NATIVE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float) -> torch.Tensor:
    """SDPA with grouped-query heads: q ``[..., Hq, q, D]``, k/v ``[..., Hkv, L, D]``."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1 and _NATIVE_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
