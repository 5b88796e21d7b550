"""kvmem's block manager makes vLLM's decisions: one serving trace (``tests/cache_replay.py``)
replayed over kvmem's ``KVCacheManager`` and over vLLM's own, in vLLM 0.32 and 0.33.

Models: one full-attention group; full attention with a sliding window; a Qwen3-Next-like
gated-delta-net hybrid (3 linear : 1 full attention) and a Nemotron-H-like Mamba2 hybrid
(state groups); each with prefix caching on (vLLM's Mamba "align" mode) and off ("none").
Every prefix hit in tokens, every allocation's outcome and new block ids per group (null
entries included), preemption, finish and the free block count after every step must be
vLLM's. The trace preempts requests, refuses allocations, evicts cached blocks and hits
the cache, so the comparison covers those decisions.
"""

from __future__ import annotations

import json
from functools import cache

import cache_replay
import pytest
import vllm_cpu

pytestmark = [pytest.mark.vllm]

SERIES = ("0.32", "0.33")
CASES = [[model, caching, 1, 100, 140] for model in cache_replay.MODELS
         for caching in (True, False)]


@cache
def vllm_logs(series: str) -> list:
    script = (vllm_cpu.REPO / "tests" / "cache_replay.py").read_text()
    return vllm_cpu.run_for_json(script, "KVMEM_REPLAY", json.dumps(CASES), series=series,
                                 timeout=900)["logs"]


def first_difference(got: list, expected: list) -> str:
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"entry {i}: kvmem {a} vLLM {b}; before: {expected[max(0, i - 4):i]}"
    return f"kvmem made {len(got)} decisions, vLLM {len(expected)}"


@pytest.mark.parametrize("series", SERIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'cache' if c[1] else 'nocache'}")
def test_kvmem_makes_vllms_decisions(series, case):
    model, caching, seed, num_requests, num_blocks = case
    expected = vllm_logs(series)[CASES.index(case)]
    backend = cache_replay.KvmemBackend(model, caching, num_blocks, series)
    got = json.loads(json.dumps(cache_replay.replay(backend, seed, num_requests, num_blocks)))
    assert got == expected, first_difference(got, expected)

    # the trace exercises what it compares
    kinds = [e[0] for e in got]
    assert kinds.count("preempt") >= 5 and kinds.count("finish") == num_requests
    assert sum(1 for e in got if e[0] == "alloc" and e[3] is None) > 10
    hits = [e[2] for e in got if e[0] == "hit"]
    assert (sum(hits) > 0) == caching
    if "state" in dict(cache_replay.MODELS[model]):
        state = [g for g, (kind, _) in enumerate(cache_replay.MODELS[model]) if kind == "state"]
        grown = [e[3][g] for e in got if e[0] == "alloc" and e[3] for g in state]
        assert all(len([b for b in ids if b]) <= 1 for ids in grown)
        if caching:  # null entries before a new checkpoint block
            assert any(ids and ids[0] == 0 for ids in grown)
