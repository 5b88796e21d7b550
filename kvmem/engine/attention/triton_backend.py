"""Triton paged attention: one kernel stores new K/V at their slots, others attend.

Prefill chunks (and steps that mix them with decodes): a program takes up to ``BLOCK_M``
query tokens of one sequence for one query head, walks that sequence's block table (only
the blocks its causal range and sliding window can see) and keeps an online softmax.

Decode-only steps: a program takes one sequence's query heads that share a KV head (the
rows of its matmuls), so each K/V block is read once per KV head rather than once per
query head, over one split of the context, a few blocks per loop step (gathered through
the block table, so that more loads are in flight); a second kernel merges the splits'
partial softmaxes. The splits give a small batch of long contexts enough programs to fill the
device (flash-decoding).

Block sizes must be powers of two of at least 16 (the matmul tile); for other sizes the
backend falls back to the reference path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvmem.engine.attention.metadata import AttentionMetadata
from kvmem.engine.attention.reference import ReferenceBackend
from kvmem.errors import ConfigError

BLOCK_M = 16
DECODE_BLOCKS_PER_TILE = 4  # KV blocks per loop step of the decode kernel (64 tokens at 16)
_MASKED = tl.constexpr(-1.0e30)  # finite: a block with no visible key yields no NaNs


@triton.jit
def _store_kv_kernel(K, V, Cache, Slots, s_kt, s_kh, s_vt, s_vh, s_cb, s_ckv, s_ct, s_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(Slots + t)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        dst = Cache + block * s_cb + offset * s_ct + h * s_ch + d
        k = tl.load(K + t * s_kt + h * s_kh + d, mask=dm)
        v = tl.load(V + t * s_vt + h * s_vh + d, mask=dm)
        tl.store(dst, k.to(Cache.dtype.element_ty), mask=dm)
        tl.store(dst + s_ckv, v.to(Cache.dtype.element_ty), mask=dm)


@triton.jit
def _fold_scores(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """The online softmax's update: fold the masked scores ``s`` of some keys, with their
    values ``v``, into the rows' running max ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_block(q, m_i, l_i, acc, Cache, BlockTables, table_row, j, kv_h, visible_to,
                  seq_len, window, scale, s_cb, s_ckv, s_ct, s_ch,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V block of the online softmax: the rows' queries (positions ``visible_to``)
    against block ``j`` of the sequence's table; returns the updated (m, l, acc)."""
    block = tl.load(BlockTables + table_row + j).to(tl.int64)
    n_local = tl.arange(0, BLOCK_SIZE)
    n = j * BLOCK_SIZE + n_local
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = Cache + block * s_cb + n_local[:, None] * s_ct + kv_h * s_ch + d[None, :]
    k = tl.load(base, mask=d_ok[None, :], other=0.0)
    v = tl.load(base + s_ckv, mask=d_ok[None, :], other=0.0)
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * scale
    visible = (n[None, :] <= visible_to[:, None]) & (n[None, :] < seq_len)
    if HAS_WINDOW:
        visible = visible & (n[None, :] > visible_to[:, None] - window)
    return _fold_scores(tl.where(visible, s, _MASKED), v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, Cache, BlockTables, table_row, j, end, kv_h, pos, window,
                 scale, s_cb, s_ckv, s_ct, s_ch,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax over ``TILE`` keys from position ``j * BLOCK_SIZE`` (one or more
    blocks, each row gathered through the block table), those before ``end`` visible to
    the one query token at ``pos``: longer tiles keep more loads in flight per program."""
    n = j * BLOCK_SIZE + tl.arange(0, TILE)
    in_range = n < end
    block = tl.load(BlockTables + table_row + n // BLOCK_SIZE, mask=in_range, other=0)
    d = tl.arange(0, BLOCK_D)
    kv_ok = in_range[:, None] & (d < HEAD_DIM)[None, :]
    base = Cache + block.to(tl.int64)[:, None] * s_cb + (n % BLOCK_SIZE)[:, None] * s_ct \
        + kv_h * s_ch + d[None, :]
    k = tl.load(base, mask=kv_ok, other=0.0)
    v = tl.load(base + s_ckv, mask=kv_ok, other=0.0)
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * scale
    visible = in_range[None, :]
    if HAS_WINDOW:
        visible = visible & (n[None, :] > pos - window)
    return _fold_scores(tl.where(visible, s, _MASKED), v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _paged_attention_kernel(
    Q, Out, Cache, BlockTables, QueryStart, SeqLens, scale,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_ckv, s_ct, s_ch, s_bt,
    window,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(QueryStart + b)
    q_len = tl.load(QueryStart + b + 1) - q_start
    seq_len = tl.load(SeqLens + b)
    if tile * BLOCK_M < q_len:
        kv_h = h // QUERIES_PER_KV
        context = seq_len - q_len  # tokens cached before this step
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < q_len
        pos = context + m
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q_start + m)[:, None] * s_qt + h * s_qh + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)

        last = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)  # one past the last key
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(0, context + tile * BLOCK_M - window + 1)
        m_i = tl.full([BLOCK_M], _MASKED, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for j in range(first // BLOCK_SIZE, tl.cdiv(last, BLOCK_SIZE)):
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, Cache, BlockTables, b * s_bt, j, kv_h, pos, seq_len,
                window, scale, s_cb, s_ckv, s_ct, s_ch, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                HAS_WINDOW, DOT_PRECISION)
        out = acc / l_i[:, None]
        tl.store(Out + (q_start + m)[:, None] * s_ot + h * s_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_decode_kernel(
    Q, PartAcc, PartML, Cache, BlockTables, SeqLens, scale,
    s_qt, s_qh, s_cb, s_ckv, s_ct, s_ch, s_bt, window, blocks_per_split,
    QUERIES_PER_KV: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    pos = seq_len - 1  # the one query token's position
    h = kv_h * QUERIES_PER_KV + tl.arange(0, BLOCK_H)
    h_ok = tl.arange(0, BLOCK_H) < QUERIES_PER_KV
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * s_qt + h[:, None] * s_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    first = split * blocks_per_split
    last = tl.minimum(tl.cdiv(seq_len, BLOCK_SIZE), first + blocks_per_split)
    if HAS_WINDOW:
        first = tl.maximum(first, tl.maximum(0, pos - window + 1) // BLOCK_SIZE)
    m_i = tl.full([BLOCK_H], _MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    end = tl.minimum(seq_len, last * BLOCK_SIZE)  # this split's keys end here
    for j in range(first, last, BLOCKS_PER_TILE):  # each tile starts at a visible key
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, Cache, BlockTables, b * s_bt, j, end, kv_h, pos, window,
            scale, s_cb, s_ckv, s_ct, s_ch, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
            BLOCK_SIZE * BLOCKS_PER_TILE, HAS_WINDOW, DOT_PRECISION)
    row = (b * NUM_HEADS + h) * NUM_SPLITS + split  # this split's partial of head h
    tl.store(PartAcc + row[:, None] * BLOCK_D + d[None, :], acc, mask=h_ok[:, None])
    tl.store(PartML + row * 2, m_i, mask=h_ok)
    tl.store(PartML + row * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _decode_merge_kernel(PartAcc, PartML, Out, s_ot, s_oh, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * NUM_HEADS + h) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(PartML + row * 2)
    l_s = tl.load(PartML + row * 2 + 1)
    weight = tl.exp(m - tl.max(m, axis=0))  # an empty split: l = 0, acc = 0, no weight
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(PartAcc + row[:, None] * BLOCK_D + d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(Out + b * s_ot + h * s_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, programs: int
                  ) -> tuple[int, int]:
    """(splits, blocks per split) of a decode step: enough programs to give ``programs``
    work (a power of two up to 16 splits), never more splits than blocks."""
    want = max(1, -(-programs // max(1, num_seqs * num_kv_heads)))
    splits = min(16, triton.next_power_of_2(want), triton.next_power_of_2(max(1, max_blocks)))
    return splits, max(1, -(-max_blocks // splits))


def _dot_precision(cache_dtype: torch.dtype) -> str | None:
    """Full-precision matmuls over fp32 caches (exact against the reference); otherwise
    Triton's default for the device."""
    return "ieee" if cache_dtype == torch.float32 else None


def _supported_block_size(block_size: int) -> bool:
    return block_size >= 16 and block_size & (block_size - 1) == 0


class TritonBackend:
    name = "triton"

    def __init__(self, decode_blocks_per_tile: int | None = None) -> None:
        """``decode_blocks_per_tile``: KV blocks a decode program reads per loop step (a
        power of two; default ``KVMEM_DECODE_BLOCKS_PER_TILE``, else
        ``DECODE_BLOCKS_PER_TILE``)."""
        self._reference = ReferenceBackend()
        self._sm_counts: dict[torch.device, int] = {}
        tile = decode_blocks_per_tile or int(os.environ.get("KVMEM_DECODE_BLOCKS_PER_TILE",
                                                            DECODE_BLOCKS_PER_TILE))
        if tile < 1 or tile & (tile - 1):
            raise ConfigError(f"KVMEM_DECODE_BLOCKS_PER_TILE must be a power of two, got {tile}")
        self.decode_blocks_per_tile = tile

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        if not _supported_block_size(block_size):
            return self._reference.forward(q, k, v, kv_cache, metadata, group_id, scale,
                                           sliding_window)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        block_d = triton.next_power_of_2(max(head_dim, 16))
        slots = metadata.slot_mappings[group_id]
        if num_tokens:
            _store_kv_kernel[(num_tokens, num_kv_heads)](
                k, v, kv_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size)
        out = torch.empty_like(q)
        block_table = metadata.block_tables[group_id]
        if metadata.is_decode_only and metadata.num_seqs:
            return self._decode(q, out, kv_cache, block_table, metadata, scale,
                                sliding_window, num_kv_heads, block_d)
        grid = (metadata.num_seqs, num_heads, triton.cdiv(max(metadata.max_query_len, 1), BLOCK_M))
        _paged_attention_kernel[grid](
            q, out, kv_cache, block_table, metadata.query_start_loc, metadata.seq_lens, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            block_table.stride(0), sliding_window or 0,
            QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, HAS_WINDOW=sliding_window is not None,
            DOT_PRECISION=_dot_precision(kv_cache.dtype))
        return out

    def _decode(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None, num_kv_heads: int, block_d: int) -> torch.Tensor:
        num_seqs, (_, num_heads, head_dim) = metadata.num_seqs, q.shape
        block_size = kv_cache.shape[2]
        queries_per_kv = num_heads // num_kv_heads
        max_blocks = -(-metadata.max_seq_len // block_size)
        tile = self.decode_blocks_per_tile
        splits, per_split = decode_splits(num_seqs, num_kv_heads, max_blocks,
                                          self._programs(q.device))
        per_split = -(-per_split // tile) * tile  # whole tiles: a split's end is a tile's
        part_acc = torch.empty((num_seqs * num_heads * splits, block_d), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((num_seqs * num_heads * splits, 2), dtype=torch.float32,
                              device=q.device)
        _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
            q, part_acc, part_ml, kv_cache, block_table, metadata.seq_lens, scale,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
            sliding_window or 0, per_split,
            QUERIES_PER_KV=queries_per_kv, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_SIZE=block_size,
            BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)), NUM_SPLITS=splits,
            BLOCKS_PER_TILE=tile, HAS_WINDOW=sliding_window is not None,
            DOT_PRECISION=_dot_precision(kv_cache.dtype))
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits)
        return out

    def _programs(self, device: torch.device) -> int:
        """Programs that keep the device busy: four per multiprocessor on a GPU; a few in
        Triton's CPU interpreter (where splits are only exercised)."""
        if device.type != "cuda":
            return 8
        if device not in self._sm_counts:
            self._sm_counts[device] = torch.cuda.get_device_properties(device)\
                .multi_processor_count
        return 4 * self._sm_counts[device]

