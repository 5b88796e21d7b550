"""Attention backends against a dense reference computed from scratch.

The Triton kernels run through Triton's CPU interpreter here (TRITON_INTERPRET=1, set
before triton is imported, in a subprocess) and on the GPU when one is present.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.engine.attention import AttentionMetadata, get_attention_backend, reference
from kvmem.engine.attention.reference import length_buckets, step_plan
from kvmem.errors import ConfigError


def random_step(query_lens, seq_lens, *, block_size=4, hq=4, hkv=2, d=8, num_blocks=512,
                seed=0, device="cpu", dtype=torch.float32):
    """A batch with a pre-filled cache: returns q, k, v, cache, metadata and the full
    per-sequence K/V (cached tokens followed by the new ones) for a dense check."""
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.zeros(num_blocks, 2, block_size, hkv, d, dtype=dtype)
    tables, keys, values = [], [], []
    for q_len, n in zip(query_lens, seq_lens, strict=True):
        table = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(table)
        kk, vv = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        for pos in range(n - q_len):  # already cached tokens
            cache[table[pos // block_size], 0, pos % block_size] = kk[pos].to(dtype)
            cache[table[pos // block_size], 1, pos % block_size] = vv[pos].to(dtype)
        keys.append(kk)
        values.append(vv)
    meta = AttentionMetadata.build(query_lens, seq_lens, [tables], block_size, device)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    k = torch.cat([kk[n - ql:] for kk, ql, n in zip(keys, query_lens, seq_lens, strict=True)])
    v = torch.cat([vv[n - ql:] for vv, ql, n in zip(values, query_lens, seq_lens, strict=True)])
    to = {"device": device, "dtype": dtype}
    return q.to(**to), k.to(**to), v.to(**to), cache.to(device), meta, keys, values


def dense_attention(q, keys, values, query_lens, seq_lens, scale, window=None):
    """Softmax attention written out with explicit loops over positions and heads."""
    out = torch.zeros_like(q, dtype=torch.float64)
    groups = q.shape[1] // keys[0].shape[1]
    row = 0
    for kk, vv, q_len, n in zip(keys, values, query_lens, seq_lens, strict=True):
        for i in range(q_len):
            p = n - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(q.shape[1]):
                kh, vh = kk[lo:p + 1, h // groups].double(), vv[lo:p + 1, h // groups].double()
                weights = torch.softmax(kh @ q[row, h].double() * scale, dim=0)
                out[row, h] = weights @ vh
            row += 1
    return out.float()


CASES = {
    "prefill": ([7, 5], [7, 5]),
    "chunked prefill after cache": ([6, 3], [11, 9]),
    "mixed prefill and decode": ([1, 9, 1], [14, 9, 3]),
    "decode only": ([1, 1, 1], [5, 17, 1]),
    "long decode": ([1, 1], [40, 33]),
    # decode over many 16-token blocks, split over programs: a split of only one sequence's
    # blocks, and splits that a short sequence leaves empty
    "decode over many blocks": ([1, 1, 1], [300, 17, 129]),
    # enough decode rows of spread-out lengths to be split into several padded batches
    "many decodes": ([1] * 20, [3 + 5 * i for i in range(20)]),
    "many decodes beside chunks": ([1] * 9 + [4] + [1] * 9 + [6],
                                   [2 + 7 * i for i in range(9)] + [10]
                                   + [80 - 3 * i for i in range(9)] + [6]),
}


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_backend_matches_dense_attention(case, window):
    query_lens, seq_lens = CASES[case]
    q, k, v, cache, meta, keys, values = random_step(query_lens, seq_lens)
    out = get_attention_backend("reference").forward(q, k, v, cache, meta, 0, 0.5, window)
    expected = dense_attention(q, keys, values, query_lens, seq_lens, 0.5, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_rows_of_different_lengths_are_split_into_batches():
    for case in ("many decodes", "many decodes beside chunks"):
        query_lens, seq_lens = CASES[case]
        *_, meta, _, _ = random_step(query_lens, seq_lens)
        plan = step_plan(meta, 0, None)
        assert len(plan.decodes) > 1
        rows = sorted(r for batch in plan.decodes for r in batch.rows.tolist())
        starts = [sum(query_lens[:b]) for b, q in enumerate(query_lens) if q == 1]
        assert rows == starts
        assert [(c.start, c.end) for c in plan.prefills] == \
            [(sum(query_lens[:b]), sum(query_lens[:b + 1]))
             for b, q in enumerate(query_lens) if q > 1]


def test_sliding_window_decode_gathers_only_the_window():
    query_lens, seq_lens = CASES["long decode"]  # 40 and 33 tokens in 4-token blocks
    q, k, v, cache, meta, keys, values = random_step(query_lens, seq_lens)
    assert step_plan(meta, 0, None).decodes[0].num_keys == 40
    assert step_plan(meta, 0, 3).decodes[0].num_keys == 8  # 3 keys span at most 2 blocks
    out = get_attention_backend("reference").forward(q, k, v, cache, meta, 0, 0.5, 3)
    expected = dense_attention(q, keys, values, query_lens, seq_lens, 0.5, 3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_length_buckets():
    lens = [50, 10, 40, 20, 30, 60, 70, 80] * 2
    buckets = length_buckets(list(range(16)), lens)
    assert len(buckets) == 2 and sorted(sum(buckets, [])) == list(range(16))
    assert max(lens[b] for b in buckets[0]) <= min(lens[b] for b in buckets[1])
    assert length_buckets(list(range(7)), lens) == [list(range(7))]  # too few to split
    alike = [200 + i for i in range(32)]  # within 20% of each other
    assert length_buckets(list(range(32)), alike) == [list(range(32))]
    assert len(length_buckets(list(range(64)), list(range(1, 65)))) == 4


def written_out_build(query_lens, seq_lens, groups, block_size):
    """Block tables and slot mappings as the metadata's contract states them, one id at a
    time: rows 0-padded to the longest, token at position p of sequence b in slot
    ``table[b][p // block_size] * block_size + p % block_size``."""
    out = []
    for group in groups:
        width = max((len(row) for row in group), default=0) or 1
        table = torch.tensor([list(row) + [0] * (width - len(row)) for row in group],
                             dtype=torch.int32).reshape(len(group), width)
        slots = [row[p // block_size] * block_size + p % block_size
                 for row, q, n in zip(group, query_lens, seq_lens, strict=True)
                 for p in range(n - q, n)]
        out.append((table, torch.tensor(slots, dtype=torch.int64)))
    return out


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    query_lens = draw(st.lists(st.integers(0, 9), max_size=6))
    seq_lens = [q + draw(st.integers(0, 40)) for q in query_lens]
    groups = [[draw(st.lists(st.integers(1, 999), min_size=-(-n // block_size),
                             max_size=-(-n // block_size) + 2)) for n in seq_lens]
              for _ in range(draw(st.integers(1, 2)))]
    return query_lens, seq_lens, groups, block_size


@given(batches())
@settings(max_examples=200, deadline=None)
def test_metadata_tables_and_slots_are_those_written_out(batch):
    meta = AttentionMetadata.build(*batch)
    for (table, slots), got_table, got_slots in zip(written_out_build(*batch),
                                                    meta.block_tables, meta.slot_mappings,
                                                    strict=True):
        assert got_table.dtype == torch.int32 and torch.equal(got_table, table)
        assert got_slots.dtype == torch.int64 and torch.equal(got_slots, slots)


def test_a_position_past_the_block_table_is_refused():
    with pytest.raises(IndexError, match="past its sequence's block table"):
        AttentionMetadata.build([1], [33], [[[1, 2]]], 16)


def test_step_plan_is_built_once_and_shared_by_layers(monkeypatch):
    calls = []
    build = reference._build_plan
    monkeypatch.setattr(reference, "_build_plan", lambda *a: calls.append(a) or build(*a))
    query_lens, seq_lens = CASES["mixed prefill and decode"]
    q, k, v, cache, meta, keys, values = random_step(query_lens, seq_lens)
    backend = get_attention_backend("reference")
    other_layer = cache.clone()
    first = backend.forward(q, k, v, cache, meta, 0, 0.5)
    second = backend.forward(q, k, v, other_layer, meta, 0, 0.5)
    assert len(calls) == 1
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    backend.forward(q, k, v, cache, meta, 0, 0.5, 3)  # another window: its own plan
    assert len(calls) == 2


def test_prefill_attends_over_kv_as_the_cache_stores_it():
    """A chunk with nothing cached uses its new K/V directly, rounded to the cache dtype
    so that it sees the same values later steps read back."""
    query_lens, seq_lens = CASES["prefill"]
    q, k, v, cache, meta, keys, values = random_step(query_lens, seq_lens)
    out = get_attention_backend("reference").forward(q, k, v, cache.bfloat16(), meta, 0, 0.5)
    rounded = [x.bfloat16().float() for x in keys], [x.bfloat16().float() for x in values]
    expected = dense_attention(q, *rounded, query_lens, seq_lens, 0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_backend_writes_only_mapped_slots():
    q, k, v, cache, meta, _, _ = random_step([3, 2], [3, 2])
    meta.slot_mappings[0][1] = -1  # second token of the first sequence: do not write
    before = cache.clone()
    get_attention_backend("reference").forward(q, k, v, cache, meta, 0, 1.0)
    table = meta.block_tables[0]
    assert torch.equal(cache[int(table[0, 0]), 0, 0], k[0])
    assert torch.equal(cache[int(table[0, 0]), 0, 1], before[int(table[0, 0]), 0, 1])
    assert torch.equal(cache[int(table[1, 0]), 1, 1], v[4])
    assert torch.equal(cache[0], before[0])  # the null block is never written
    changed = (cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted({int(table[0, 0]), int(table[1, 0])})


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_auto_backend_on_cpu_is_reference():
    assert get_attention_backend("auto", "cpu").name == "reference"


TRITON_CHECK = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_attention import CASES, dense_attention, random_step
    from kvmem.engine.attention import get_attention_backend
    from kvmem.engine.attention.triton_backend import TritonBackend
    device = {device!r}
    # the engine's backend, and decode tiles of one block and of eight (past most contexts)
    backends = [get_attention_backend("triton"), TritonBackend(1), TritonBackend(8)]
    for name, (query_lens, seq_lens) in CASES.items():
        for window, backend in ((None, backends[0]), (5, backends[0]), (None, backends[1]),
                                (5, backends[1]), (None, backends[2]), (40, backends[2])):
            for hq, hkv, d in ((4, 2, 16), (3, 1, 24)):
                q, k, v, cache, meta, keys, values = random_step(
                    query_lens, seq_lens, block_size=16, hq=hq, hkv=hkv, d=d, device=device)
                # put the new tokens' K/V in a cache: the kernel must write them itself
                out = backend.forward(q, k, v, cache, meta, 0, 0.3, window)
                expected = dense_attention(q.cpu(), keys, values, query_lens, seq_lens, 0.3,
                                           window)
                torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-4)
                slots = meta.slot_mappings[0].cpu()
                written = cache.cpu()[slots // 16, 0, slots % 16]
                torch.testing.assert_close(written, k.cpu())
    print("triton ok")
""")


def test_triton_kernels_in_interpreter_match_dense_attention():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = TRITON_CHECK.format(tests=str(Path(__file__).parent), device="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton ok" in result.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_on_cuda_match_dense_attention():
    script = TRITON_CHECK.format(tests=str(Path(__file__).parent), device="cuda")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton ok" in result.stdout
