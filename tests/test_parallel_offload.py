"""CPU offload under tensor x pipeline parallelism when the driver cannot map the
workers' KV: elastic KV, and plain KV with shared memory turned off, both through the
workers' copy services (``kvmem.engine.distributed.remote_copy``).

tp 2 x pp 2 on CPU (gloo), a tiny model and a 20-block pool: prompt A, then B (which
evicts A's tail from the pool), then A again, whose evicted blocks come back from the
CPU tier. Tokens equal a big single-process engine's, and both KV layouts give the same
tier statistics as the shared-memory path.
"""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_checkpoint

import kvmem.engine.rank_builder as rank_builder
from kvmem.engine.distributed.offload import RemoteKVStorage, SharedKVStorage
from kvmem.engine.llm import LLM
from kvmem.engine.sampling_params import SamplingParams

TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
BLOCK_BYTES_PER_LAYER = 16 * 2 * 2 * 16 * 4  # block of 16 tokens, K and V, 2 heads, fp32
PER_RANK = 20 * 2 * BLOCK_BYTES_PER_LAYER // 2  # 20 blocks of 2 layers x 1 head
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FIRST, SECOND = list(range(10, 130)), list(range(300, 100, -1))
OPTIONS = dict(kv_cache_memory_bytes=PER_RANK, max_model_len=256, max_num_batched_tokens=64,
               tensor_parallel_size=2, pipeline_parallel_size=2, cpu_offload_gib=1 / 64)


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_LEDGER_DIR", str(tmp_path / "ledger"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("parallel-offload"), "llama", **TINY)


@pytest.fixture(scope="module")
def expected(model_dir):
    big = LLM(str(model_dir), kv_cache_memory_bytes="4MiB", max_model_len=256)
    return [big.generate([p], PARAMS)[0].outputs[0].token_ids for p in (FIRST, SECOND, FIRST)]


def run_a_b_a(model_dir, **options) -> tuple[list[list[int]], tuple, type]:
    """Tokens of A, B, A; the CPU tier's (hits, bytes loaded and stored, failed loads);
    the storage type the tiers copy through."""
    llm = LLM(str(model_dir), **OPTIONS, **options)
    engine = llm.engine
    try:
        storage = type(engine.offload_storage)
        outs = []
        for prompt in (FIRST, SECOND, FIRST):
            outs.append(llm.generate([prompt], PARAMS)[0])
            engine.offload.offload.drain()  # stores land before the next prompt: same stats
        assert outs[2].num_cached_tokens >= 7 * 16  # pool head + CPU tail: the whole prefix
        cpu = engine.offload.stats()["cpu"]
        stats = (cpu.hits, cpu.bytes_loaded, cpu.bytes_stored, cpu.failed_loads)
        assert cpu.hits >= 1 and cpu.bytes_loaded > 0 and cpu.failed_loads == 0
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.parallel.processes.values())
    return [o.outputs[0].token_ids for o in outs], stats, storage


def test_elastic_kv_offloads_through_copy_services(model_dir, expected):
    tokens, stats, storage = run_a_b_a(model_dir, kv_memory="elastic")
    assert storage is RemoteKVStorage
    assert tokens == expected


def test_plain_kv_copy_services_match_shared_memory(model_dir, expected, monkeypatch):
    shared = run_a_b_a(model_dir)
    monkeypatch.setattr(rank_builder, "SHARE_LOCAL_KV", False)
    remote = run_a_b_a(model_dir)
    assert (shared[2], remote[2]) == (SharedKVStorage, RemoteKVStorage)
    assert shared[0] == remote[0] == expected
    assert shared[1] == remote[1]
