"""The CPU paged decode and prefill kernels agree with the SDPA-over-gathered-blocks path
they replace."""

import random

import pytest
import torch

from kvmem.engine.attention import cpu_kernels
from kvmem.engine.attention.metadata import AttentionMetadata
from kvmem.engine.attention.reference import ReferenceBackend, write_kv

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="no C compiler for the CPU kernel")


def _sdpa_only(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "supports", lambda q, kv_cache: False)


def _case(seed: int, query_lens: list[int], context: list[int], heads: int, kv_heads: int,
          dtype: torch.dtype, block_size: int = 16, head_dim: int = 64):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context, query_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, used = [], 0
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(ids[used:used + k])
        used += k
    cache = torch.randn((num_blocks, 2, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    tokens = sum(query_lens)
    q, k, v = (torch.randn((tokens, h, head_dim), generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    metadata = AttentionMetadata.build(query_lens, seq_lens, [tables], block_size)
    return q, k, v, cache, metadata


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens", [[1] * 6, [1, 5, 1, 1, 9, 1]])
def test_kernel_matches_sdpa(monkeypatch, window, dtype, query_lens):
    context = [3, 130, 47, 16, 0, 300]
    args = _case(0, query_lens, context, heads=6, kv_heads=2, dtype=dtype)
    q, k, v, cache, metadata = args
    assert cpu_kernels.supports(q, cache)
    cache_sdpa = cache.clone()
    paged = ReferenceBackend().forward(q, k, v, cache, metadata, 0, 0.125, window)
    _sdpa_only(monkeypatch)  # the step's plans are cached per path: both are built
    sdpa = ReferenceBackend().forward(q, k, v, cache_sdpa, metadata, 0, 0.125, window)
    assert torch.equal(cache, cache_sdpa)  # both stored the new K/V the same way
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(paged.float(), sdpa.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim, heads, kv_heads", [(128, 4, 1), (80, 6, 3), (64, 4, 4)])
def test_other_head_sizes_and_groups_match_sdpa(monkeypatch, head_dim, heads, kv_heads):
    """head_dim 128 has its own loop, 80 the generic one; 4 over 4 is plain multi-head."""
    q, k, v, cache, metadata = _case(1, [1] * 5, [20, 33, 1, 64, 90], heads=heads,
                                     kv_heads=kv_heads, dtype=torch.float32,
                                     head_dim=head_dim)
    _assert_matches_sdpa(monkeypatch, q, k, v, cache, metadata, head_dim ** -0.5, None)


@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (32, 8, 1, 64),    # 16-token chunks, two per block
    (48, 12, 2, 128),  # three chunks per block, 6 query heads per KV head
    (8, 6, 2, 64),     # blocks below 16 tokens: the per-token loop
    (16, 10, 2, 64),   # 5 query heads per KV head: the per-token loop
])
@pytest.mark.parametrize("window", [None, 21])
def test_block_sizes_and_groups_match_sdpa(monkeypatch, block_size, heads, kv_heads, head_dim,
                                           window):
    """Sequences ending inside, at the end of and just past a 16-token chunk."""
    q, k, v, cache, metadata = _case(2, [1] * 6, [0, 14, 15, 16, 47, 200], heads=heads,
                                     kv_heads=kv_heads, dtype=torch.float32,
                                     block_size=block_size, head_dim=head_dim)
    _assert_matches_sdpa(monkeypatch, q, k, v, cache, metadata, head_dim ** -0.5, window)


def test_sequences_sharing_a_prefix_keep_their_rows(monkeypatch):
    """Sequences sharing their first blocks run one after another inside the kernel; each
    output still lands in its own row (interleaved prefixes, a mixed step with prefills)."""
    gen = torch.Generator().manual_seed(3)
    block_size, heads, kv_heads, dim = 16, 6, 2, 64
    prefixes = [[7, 3, 9], [2, 8, 5]]  # 48-token cached prefixes
    tails = [[11], [12, 13], [14], [15, 16], [17], [18, 19, 20]]
    tables = [prefixes[i % 2] + t for i, t in enumerate(tails)]
    query_lens = [1, 1, 5, 1, 1, 1]
    seq_lens = [48 + 16 * len(t) - 3 for t in tails]
    cache = torch.randn((24, 2, block_size, kv_heads, dim), generator=gen)
    q, k, v = (torch.randn((sum(query_lens), h, dim), generator=gen)
               for h in (heads, kv_heads, kv_heads))
    metadata = AttentionMetadata.build(query_lens, seq_lens, [tables], block_size)
    _assert_matches_sdpa(monkeypatch, q, k, v, cache, metadata, dim ** -0.5, None)


def _assert_matches_sdpa(monkeypatch, q, k, v, cache, metadata, scale, window) -> None:
    """fp32: the kernel's output equals the SDPA path's within 1e-5."""
    assert cpu_kernels.supports(q, cache)
    cache_sdpa = cache.clone()
    paged = ReferenceBackend().forward(q, k, v, cache, metadata, 0, scale, window)
    _sdpa_only(monkeypatch)
    sdpa = ReferenceBackend().forward(q, k, v, cache_sdpa, metadata, 0, scale, window)
    torch.testing.assert_close(paged, sdpa, atol=1e-5, rtol=1e-5)


def _prefill_kernel_runs(head_dim: int = 64, group: int = 3) -> bool:
    library = cpu_kernels.library()
    return library is not None and bool(library.kvmem_prefill_supported(head_dim, group))


@pytest.mark.skipif(not _prefill_kernel_runs(), reason="no AVX-512 for the prefill kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads, block_size", [
    (64, 9, 3, 16),    # SmolLM2's heads
    (128, 8, 2, 32),   # two rows per set
    (64, 5, 5, 16),    # plain multi-head, row sets straddle positions
])
@pytest.mark.parametrize("window", [None, 45])
def test_prefill_kernel_matches_sdpa(monkeypatch, dtype, head_dim, heads, kv_heads,
                                     block_size, window):
    """Long chunks from scratch and after a cached context (tiles before, across and past
    the diagonal, a chunk of two tokens, lengths off the 32-key tiles), between decodes."""
    query_lens = [70, 1, 200, 2, 1, 33]
    context = [0, 40, 37, 300, 9, 95]
    q, k, v, cache, metadata = _case(4, query_lens, context, heads=heads, kv_heads=kv_heads,
                                     dtype=dtype, block_size=block_size, head_dim=head_dim)
    cache_sdpa = cache.clone()
    kernel = ReferenceBackend().forward(q, k, v, cache, metadata, 0, head_dim ** -0.5, window)
    _sdpa_only(monkeypatch)
    sdpa = ReferenceBackend().forward(q, k, v, cache_sdpa, metadata, 0, head_dim ** -0.5,
                                      window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kernel.float(), sdpa.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not _prefill_kernel_runs(), reason="no AVX-512 for the prefill kernel")
def test_prefill_kernel_runs_and_declines_what_it_cannot_do():
    q, k, v, cache, metadata = _case(5, [40], [0], heads=6, kv_heads=2, dtype=torch.float32)
    write_kv(cache, k, v, metadata.slot_mappings[0])
    args = (torch.tensor([0]), torch.tensor([40]), torch.tensor([40]),
            metadata.block_tables[0], 0.125, None)
    out = cpu_kernels.paged_prefill(q, cache, *args)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(3, 0),
        v.transpose(0, 1).repeat_interleave(3, 0), is_causal=True, scale=0.125).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert cpu_kernels.paged_prefill(q.double(), cache.double(), *args) is None  # dtype
    assert cpu_kernels.paged_prefill(q.bfloat16(), cache, *args) is None  # q and cache differ
    narrow = torch.randn(40, 6, 32)
    assert cpu_kernels.paged_prefill(narrow, cache[..., :32].contiguous(), *args) is None


def test_unsupported_layouts_fall_back():
    q = torch.randn(2, 4, 64)
    assert not cpu_kernels.supports(q, torch.randn(4, 2, 16, 3, 64))  # 4 heads over 3
    assert not cpu_kernels.supports(q, torch.randn(4, 2, 16, 2, 32))  # head_dim differs
    assert not cpu_kernels.supports(q, torch.randn(4, 2, 512, 2, 64))  # block too large
    assert not cpu_kernels.supports(q, torch.randn(4, 2, 16, 2, 64).half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_store_equals_the_indexed_store(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim, block_size = 23, 4, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)  # strided rows
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(10 * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # tokens without a slot
    cache = torch.randn(10, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    expected = cache.clone()
    write_kv(cache, k, v, slots)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "store_kv", lambda *args: False)
        write_kv(expected, k, v, slots)
    assert torch.equal(cache, expected)


def test_cache_store_refuses_what_it_cannot_copy():
    cache = torch.zeros(4, 2, 4, 2, 8)
    k = v = torch.ones(3, 2, 8)
    with pytest.raises(IndexError, match="past the cache"):
        cpu_kernels.store_kv(cache, k, v, torch.tensor([0, 16, 1]))
    assert cache[0, :, 0].eq(1).all() and cache.sum() == 2 * 16  # token 0 only
    assert not cpu_kernels.store_kv(cache, k.bfloat16(), v.bfloat16(), torch.tensor([0, 1, 2]))
    assert not cpu_kernels.store_kv(cache, k.transpose(1, 2).contiguous().transpose(1, 2), v,
                                    torch.tensor([0, 1, 2]))
    assert not cpu_kernels.store_kv(cache, k, v, torch.tensor([0, 1, 2], dtype=torch.int32))
