"""Reference attention: PyTorch SDPA over K/V gathered from the paged cache.

Exact, and runs on CPU and GPU. What a step's layers share is worked out once per step
and KV group (a ``StepPlan``, kept in ``AttentionMetadata.step_cache``): which rows
decode, their block indices and padding mask, and how each prefill chunk attends. A
layer then only gathers and calls SDPA:

- decode rows, grouped by context length into a few padded batches (less padding):
  one ``index_select`` over the block dimension for K and one for V (each a contiguous
  ``[B, L, Hkv, D]`` result, no second copy), then one SDPA call per batch with the
  query heads that share a KV head folded into the query dimension, so each K/V head is
  read once; under a sliding window only the blocks the window can see are gathered;
- a prefill chunk with no cached prefix attends over its own new K/V with ``is_causal``
  (nothing is read back from the cache); a chunk after a cached prefix gathers its
  blocks and uses an explicit mask. Where the CPU kernels run, all prefill chunks of a step
  go to one call of the C prefill kernel instead (``prefill.c``), which reads the cache's
  blocks itself.

A decode-only batch whose lengths are alike (always so in a CUDA graph's metadata) is one
batch derived from device tensors only (no host reads), so it can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmem.engine.attention import cpu_kernels
from kvmem.engine.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's k/v at its slot; slots of -1 are skipped.

    On a GPU, skipped tokens rewrite slot 0's current value onto itself instead of being
    filtered out, so that no step reads a device value back to the host (CUDA-graph safe);
    on the CPU that read is free, and each side is one indexed store.
    """
    block_size = kv_cache.shape[2]
    if kv_cache.device.type == "cpu":
        if cpu_kernels.store_kv(kv_cache, k, v, slot_mapping):
            return
        if not bool((slot_mapping >= 0).all()):
            kept = (slot_mapping >= 0).nonzero().squeeze(1)
            slot_mapping, k, v = slot_mapping[kept], k[kept], v[kept]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)
        return
    keep = (slot_mapping >= 0).view(-1, 1, 1)
    slots = slot_mapping.clamp(min=0)
    blocks, offsets = slots // block_size, slots % block_size
    for i, new in ((0, k), (1, v)):
        old = kv_cache[blocks, i, offsets]
        kv_cache[blocks, i, offsets] = torch.where(keep, new.to(kv_cache.dtype), old)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``block_ids`` (int64 ``[n]``), each ``[n * block_size, Hkv, D]``.

    ``kv_cache[:, 0]`` is a strided view, but each block in it is contiguous, so one
    ``index_select`` per side copies whole blocks into a contiguous result.
    """
    _, _, block_size, heads, dim = kv_cache.shape
    n = block_ids.shape[0]
    keys = kv_cache[:, 0].index_select(0, block_ids).view(n * block_size, heads, dim)
    values = kv_cache[:, 1].index_select(0, block_ids).view(n * block_size, heads, dim)
    return keys, values


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


@dataclass
class DecodeBatch:
    """One-token sequences of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor | None  # int64 token rows of these sequences; None: every row, in order
    block_ids: torch.Tensor  # int64 [B * n]: each sequence's first n block ids, 0-padded
    num_keys: int  # n * block_size keys per sequence (padding masked)
    mask: torch.Tensor  # bool [B, 1, 1, num_keys]


@dataclass
class PrefillChunk:
    """One sequence's chunk of several new tokens, at token rows ``start:end``."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # int64; None: no cached prefix, attend over the new K/V
    mask: torch.Tensor | None  # bool [q_len, seq_len]; None: plain causal (is_causal)


@dataclass
class PagedDecodes:
    """All one-token sequences of a step, for the CPU paged kernel (no gather, no padding)."""

    rows: torch.Tensor | None  # int64 token rows of these sequences; None: every row, in order
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]


@dataclass
class PagedPrefills:
    """All prefill chunks of a step, for the CPU prefill kernel (K/V read from the cache)."""

    starts: torch.Tensor  # int64 [C]: each chunk's first token row
    q_lens: torch.Tensor  # int64 [C]
    seq_lens: torch.Tensor  # int64 [C]: the chunk's tokens included
    block_table: torch.Tensor  # int32 [C, max_blocks]


@dataclass
class StepPlan:
    decodes: list[DecodeBatch]
    prefills: list[PrefillChunk]
    paged: PagedDecodes | None = None  # set instead of ``decodes`` when the kernel runs
    paged_prefills: PagedPrefills | None = None  # with ``paged``: the prefill chunks too


def step_plan(metadata: AttentionMetadata, group_id: int, sliding_window: int | None,
              paged: bool = False) -> StepPlan:
    """The plan of this step for one KV group and window, built by the first layer to ask.

    ``paged``: decode rows go to the CPU paged kernel rather than to padded SDPA batches.
    """
    key = ("reference", group_id, sliding_window, paged)
    plan = metadata.step_cache.get(key)
    if plan is None:
        plan = _build_plan(metadata, metadata.block_tables[group_id], sliding_window, paged)
        metadata.step_cache[key] = plan
    return plan


def length_buckets(seqs: list[int], seq_lens: list[int], *, max_buckets: int = 4,
                   min_bucket: int = 8) -> list[list[int]]:
    """``seqs`` split into up to ``max_buckets`` groups of similar length (shortest first).

    Every sequence of a padded batch costs the longest one's gather and attention, so
    sorting by length and cutting into equal-count groups trims the padding; groups stay
    at least ``min_bucket`` large to keep the per-call overhead small. Lengths within 20%
    of each other are not worth splitting.
    """
    order = sorted(seqs, key=seq_lens.__getitem__)
    k = min(max_buckets, len(order) // min_bucket)
    if k < 2 or seq_lens[order[0]] >= 0.8 * seq_lens[order[-1]]:
        return [seqs]
    return [order[i * len(order) // k:(i + 1) * len(order) // k] for i in range(k)]


def _build_plan(metadata: AttentionMetadata, block_table: torch.Tensor,
                sliding_window: int | None, paged: bool = False) -> StepPlan:
    block_size = metadata.block_size
    device = block_table.device
    lens = metadata.seq_lens_cpu
    decode_seqs: list[int] = []
    prefill_seqs: list[int] = []
    prefills: list[PrefillChunk] = []
    if metadata.is_decode_only:
        decode_seqs = list(range(metadata.num_seqs))
    else:
        start = 0
        for b, (q_len, seq_len) in enumerate(zip(metadata.query_lens, lens, strict=True)):
            if q_len == 1:
                decode_seqs.append(b)
            elif q_len > 1:
                prefill_seqs.append(b)
                prefills.append(_prefill_chunk(b, start, q_len, seq_len, block_table,
                                               block_size, sliding_window))
            start += q_len
    if paged:
        return StepPlan([], prefills, _paged_decodes(metadata, block_table, decode_seqs),
                        _paged_prefills(metadata, block_table, prefill_seqs))
    buckets = length_buckets(decode_seqs, lens) if decode_seqs else []
    if metadata.is_decode_only and len(buckets) == 1:
        # the whole batch in order, from device tensors only: CUDA-graph safe
        batch = _decode_batch(None, block_table, metadata.seq_lens, metadata.max_seq_len,
                              block_size, sliding_window)
        return StepPlan([batch], [])
    starts = _cumsum(metadata.query_lens)
    decodes = []
    for bucket in buckets:
        seqs = torch.tensor(bucket, dtype=torch.long, device=device)
        rows = torch.tensor([starts[b] for b in bucket], dtype=torch.long, device=device)
        decodes.append(_decode_batch(rows, block_table.index_select(0, seqs),
                                     metadata.seq_lens.to(device).index_select(0, seqs),
                                     max(lens[b] for b in bucket), block_size, sliding_window))
    return StepPlan(decodes, prefills)


def _paged_decodes(metadata: AttentionMetadata, block_table: torch.Tensor,
                   decode_seqs: list[int]) -> PagedDecodes | None:
    if not decode_seqs:
        return None
    if metadata.is_decode_only:
        return PagedDecodes(None, block_table, metadata.seq_lens)
    starts = _cumsum(metadata.query_lens)
    seqs = torch.tensor(decode_seqs, dtype=torch.long)
    return PagedDecodes(torch.tensor([starts[b] for b in decode_seqs], dtype=torch.long),
                        block_table.index_select(0, seqs),
                        metadata.seq_lens.index_select(0, seqs))


def _paged_prefills(metadata: AttentionMetadata, block_table: torch.Tensor,
                    prefill_seqs: list[int]) -> PagedPrefills | None:
    if not prefill_seqs:
        return None
    starts = _cumsum(metadata.query_lens)
    seqs = torch.tensor(prefill_seqs, dtype=torch.long)
    return PagedPrefills(torch.tensor([starts[b] for b in prefill_seqs], dtype=torch.long),
                         torch.tensor([metadata.query_lens[b] for b in prefill_seqs],
                                      dtype=torch.long),
                         torch.tensor([metadata.seq_lens_cpu[b] for b in prefill_seqs],
                                      dtype=torch.long),
                         block_table.index_select(0, seqs))


def _cumsum(counts: list[int]) -> list[int]:
    """Start offset of each entry: ``[0, c0, c0 + c1, ...]`` (one per entry)."""
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _decode_batch(rows: torch.Tensor | None, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  max_seq_len: int, block_size: int, sliding_window: int | None
                  ) -> DecodeBatch:
    n = -(-max_seq_len // block_size)
    pos = (seq_lens.long() - 1).view(-1, 1)  # each sequence's new token
    window_blocks = n if sliding_window is None else -(-(sliding_window - 1) // block_size) + 1
    if window_blocks < n:  # gather only the blocks the window can see
        first = (pos - sliding_window + 1).clamp(min=0) // block_size  # [B, 1]
        cols = first + torch.arange(window_blocks, device=pos.device)
        # columns past the table only hold keys after the query; they are masked
        block_ids = block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1))
        keys = first * block_size + torch.arange(window_blocks * block_size, device=pos.device)
        mask = (keys <= pos) & (keys > pos - sliding_window)  # [B, L]
        return DecodeBatch(rows=rows, block_ids=block_ids.long().flatten(),
                           num_keys=window_blocks * block_size,
                           mask=mask.view(mask.shape[0], 1, 1, -1))
    mask = attention_mask(pos, n * block_size, sliding_window)  # [B, 1, L]
    return DecodeBatch(rows=rows, block_ids=block_table[:, :n].long().flatten(),
                       num_keys=n * block_size, mask=mask.unsqueeze(1))


def _prefill_chunk(b: int, start: int, q_len: int, seq_len: int, block_table: torch.Tensor,
                   block_size: int, sliding_window: int | None) -> PrefillChunk:
    device = block_table.device
    if q_len == seq_len:  # nothing cached before this chunk: its own K/V are the context
        mask = None if sliding_window is None else \
            attention_mask(torch.arange(q_len, device=device), q_len, sliding_window)
        return PrefillChunk(start, start + q_len, seq_len, None, mask)
    n = -(-seq_len // block_size)
    pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return PrefillChunk(start, start + q_len, seq_len, block_table[b, :n].long(),
                        attention_mask(pos, seq_len, sliding_window))


class ReferenceBackend:
    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mappings[group_id])
        paged = cpu_kernels.supports(q, kv_cache)
        plan = step_plan(metadata, group_id, sliding_window, paged)
        if len(plan.decodes) == 1 and plan.decodes[0].rows is None:
            return self._decode(q, kv_cache, plan.decodes[0], scale)
        out = torch.empty_like(q)
        if plan.paged is not None:
            decoded = cpu_kernels.paged_decode(q, plan.paged.rows, kv_cache,
                                               plan.paged.block_table, plan.paged.seq_lens,
                                               scale, sliding_window)
            if plan.paged.rows is None:  # a decode-only step
                return decoded
            out.index_copy_(0, plan.paged.rows, decoded)
        for batch in plan.decodes:
            out.index_copy_(0, batch.rows, self._decode(q.index_select(0, batch.rows), kv_cache,
                                                        batch, scale))
        prefills = plan.prefills
        if plan.paged_prefills is not None:
            chunks = plan.paged_prefills
            attended = cpu_kernels.paged_prefill(q, kv_cache, chunks.starts, chunks.q_lens,
                                                 chunks.seq_lens, chunks.block_table, scale,
                                                 sliding_window)
            if attended is not None:
                for chunk in prefills:
                    out[chunk.start:chunk.end] = attended[chunk.start:chunk.end]
                prefills = []
        for chunk in prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, kv_cache, chunk, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, plan: DecodeBatch, scale: float
                ) -> torch.Tensor:
        """q ``[B, Hq, D]`` of one-token sequences -> ``[B, Hq, D]``."""
        batch, num_heads, dim = q.shape
        keys, values = gather_kv(kv_cache, plan.block_ids)
        kv_heads = keys.shape[1]
        shape = (batch, plan.num_keys, kv_heads, dim)
        keys = keys.view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        values = values.view(shape).transpose(1, 2).to(q.dtype)
        # the query heads of one KV head act as that head's query rows: [B, Hkv, G, D]
        grouped = q.reshape(batch, kv_heads, num_heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask,
                                             scale=scale)
        return out.reshape(batch, num_heads, dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 chunk: PrefillChunk, scale: float) -> torch.Tensor:
        """One chunk's rows of q -> ``[q_len, Hq, D]``."""
        rows = slice(chunk.start, chunk.end)
        if chunk.block_ids is None:
            keys, values = k[rows], v[rows]
            if kv_cache.dtype != q.dtype:  # attend over what the cache holds, as later steps do
                keys, values = keys.to(kv_cache.dtype), values.to(kv_cache.dtype)
        else:
            keys, values = gather_kv(kv_cache, chunk.block_ids)
            keys, values = keys[:chunk.seq_len], values[:chunk.seq_len]
        out = _sdpa(q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                    chunk.mask, scale)
        return out.transpose(0, 1)


# SDPA shares K/V heads between query heads itself since torch 2.5 (no copies)
_NATIVE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """Causal SDPA with grouped-query heads: q ``[Hq, q, D]``, k/v ``[Hkv, L, D]``.

    ``mask`` None means plain causal attention over keys that are exactly the queries.
    """
    # a leading batch dimension: on CPU only 4-d inputs take the fused (flash) kernel
    q, k, v = q.unsqueeze(0), k.to(q.dtype).unsqueeze(0), v.to(q.dtype).unsqueeze(0)
    groups = q.shape[1] // k.shape[1]
    kwargs = {"attn_mask": mask, "is_causal": mask is None, "scale": scale}
    if groups > 1 and _NATIVE_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs).squeeze(0)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kwargs).squeeze(0)
