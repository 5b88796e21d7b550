"""Offloading in the real engine (fp32, greedy): MISSION.md problem 3 end to end with the
embedded SmolLM2-135M, a hybrid model (tiny qwen2: full + sliding-window layers) whose
prompt comes back from the CPU tier, also when a block fails to load, a fault-injection
soak (a tiny random llama, so that its 1,000 requests stay quick), and a disk tier reused
across processes."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
from tiny_models import make_tiny_checkpoint

from kvmem.cache.hashing import hash_request_tokens
from kvmem.engine.config import EngineConfig
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import ConfigError
from kvmem.tiers import Faults, OffloadConfig
from kvmem.tiers.blocks import key_name
from kvmem.tiers.faults import NO_FAULTS

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny llama: 2 layers, 2 KV heads, head_dim 16
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(num_blocks: int, max_model_len: int, model: str | None = None,
                bytes_per_token: int = BYTES_PER_TOKEN, offload: OffloadConfig | None = None,
                faults: Faults = NO_FAULTS, **options) -> LLMEngine:
    """An engine of ``num_blocks`` KV blocks; ``offload``: its tiers (``faults`` injected)."""
    return LLMEngine(EngineConfig(model=model, max_model_len=max_model_len,
                                  max_num_batched_tokens=512,
                                  kv_cache_memory_bytes=num_blocks * 16 * bytes_per_token,
                                  **options), offload=offload, offload_faults=faults)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("offload"), "llama"))


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int = 6):
    request = engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                                     **GREEDY))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return request, final


def kvmem_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """kvmem threads started since ``before`` that are still running."""
    return [t for t in threading.enumerate() if t.name.startswith("kvmem-") and t not in before]


def test_mission3_repeated_long_prompt_comes_back_from_cpu_tier():
    """A pool that one long prompt mostly fills, slow stores holding the first prompt's blocks
    while the second arrives, then the first prompt again: no crash, exact tokens, CPU hit."""
    threads_before = set(threading.enumerate())
    rng = random.Random(3)
    first = [rng.randrange(100, 40000) for _ in range(300)]
    second = [rng.randrange(100, 40000) for _ in range(300)]
    prompts = [("a", first), ("b", second), ("a-again", first)]

    reference = make_engine(num_blocks=25, max_model_len=384)
    expected = [run_one(reference, rid, p)[1].outputs[0].token_ids for rid, p in prompts]

    engine = make_engine(num_blocks=25, max_model_len=384,
                         offload=OffloadConfig(cpu_bytes=64 << 20),
                         faults=Faults(store_delay_s=0.5))
    connector = engine.offload
    try:
        results = [run_one(engine, rid, p) for rid, p in prompts]
        for (_, out), tokens in zip(results, expected, strict=True):
            assert out.error is None and out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == tokens
        third = results[2][0]
        cpu = connector.offload.stats()["cpu"]
        # 299 tokens may be skipped: 18 full blocks, from the CPU tier where the pool no
        # longer has them (one load: each loaded block is one hit).
        assert third.num_cached_tokens == 18 * 16
        assert 0 < cpu.hits <= 18 and cpu.failed_loads == 0
        assert cpu.bytes_loaded == cpu.hits * 16 * BYTES_PER_TOKEN
        assert engine.kv_usage().held == 0 and engine.kv_usage().used == 0
    finally:
        connector.shutdown()
    assert not kvmem_threads(threads_before)


@pytest.mark.slow
def test_soak_random_requests_with_faults(tmp_path, tiny_model):
    """1,000 random requests with shared prefixes and random aborts against a 40-block pool,
    both tiers on, slow stores, failed reads, corrupted files and a disk that fills up.
    About 5% of the requests are aborted a few steps after they arrive (waiting, running
    or loading from a tier), whatever the timing of the transfers.

    The reference is the engine without offloading, run batched. fp32 sums in a different
    batch shape can flip a near-tied greedy choice, so an output that differs from the
    batched reference must equal the prompt computed alone (no batch, no cache), and such
    flips must stay rare."""
    threads_before = set(threading.enumerate())
    rng = random.Random(7)
    prefixes = [[rng.randrange(0, 256) for _ in range(rng.randrange(32, 97))]
                for _ in range(6)]
    requests, abort_after = [], {}
    for i in range(1000):
        prefix = rng.choice(prefixes)
        prompt = prefix[:rng.randrange(16, len(prefix) + 1)] + \
            [rng.randrange(0, 256) for _ in range(rng.randrange(0, 41))]
        requests.append((f"r{i}", prompt, rng.randrange(1, 5)))
        if rng.random() < 0.05:
            abort_after[f"r{i}"] = rng.randrange(0, 6)  # engine steps after it arrives

    tiny = dict(model=tiny_model, bytes_per_token=TINY_BYTES_PER_TOKEN)
    reference = make_engine(num_blocks=40, max_model_len=160, **tiny)
    unique = {tuple(p) for _, p, _ in requests}
    expected: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(sorted(unique)):
        reference.add_request(f"ref{i}", list(prompt), SamplingParams(max_tokens=4, **GREEDY))
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                expected[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
    del reference

    block_bytes = 16 * TINY_BYTES_PER_TOKEN
    faults = Faults(store_delay_s=0.002, read_error_rate=0.03, corrupt_rate=0.05, seed=1)
    engine = make_engine(num_blocks=40, max_model_len=160, **tiny, offload=OffloadConfig(
        cpu_bytes=30 * block_bytes, disk_dir=str(tmp_path / "tier"),
        disk_bytes=200 * (block_bytes + 200)), faults=faults)
    connector = engine.offload
    finals: dict[str, object] = {}
    aborted: set[str] = set()
    abort_at: dict[str, int] = {}  # request id -> loop iteration at which it is aborted
    pending = list(reversed(requests))
    try:
        iteration = 0
        while pending or engine.has_unfinished_requests():
            iteration += 1
            for _ in range(rng.randrange(0, 4)):
                if pending:
                    rid, prompt, max_tokens = pending.pop()
                    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                   **GREEDY))
                    if rid in abort_after:
                        abort_at[rid] = iteration + abort_after[rid]
            faults.disk_full = 300 <= len(finals) < 500
            for rid in [r for r, at in abort_at.items() if at <= iteration]:
                del abort_at[rid]
                if rid in engine.requests:
                    aborted.add(rid)
                    for out in engine.abort_request(rid):
                        finals[out.request_id] = out
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert len(finals) == len(requests)
        alone = make_engine(num_blocks=40, max_model_len=160, enable_prefix_caching=False,
                            **tiny)
        completed = errors = flips = 0
        for rid, prompt, max_tokens in requests:
            out = finals[rid]
            if rid in aborted:
                continue
            if out.error is not None:
                errors += 1
                assert "\n" not in out.error and out.error
                continue
            completed += 1
            if out.outputs[0].token_ids != expected[tuple(prompt)][:max_tokens]:
                flips += 1
                _, solo = run_one(alone, f"alone-{rid}", prompt, max_tokens)
                assert out.outputs[0].token_ids == solo.outputs[0].token_ids, rid
        assert completed > 800 and flips <= completed // 100 and len(aborted) >= 10
        stats = connector.offload.stats()
        assert stats["cpu"].hits > 0 and stats["disk"].hits > 0
        assert stats["cpu"].failed_loads + stats["disk"].failed_loads > 0
        assert stats["disk"].skipped_stores > 0
    finally:
        connector.shutdown()  # stores still copying are dropped and their holds released
    usage = engine.kv_usage()
    assert usage.used == 0 and usage.held == 0 and usage.free + usage.cached == usage.total
    assert not kvmem_threads(threads_before)


_RESTART_SCRIPT = """
import json, sys
from kvmem.cache.hashing import hash_request_tokens
from kvmem.engine.config import EngineConfig
from kvmem.errors import ConfigError
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams
from kvmem.tiers import OffloadConfig

disk_dir, block_size, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
engine = LLMEngine(EngineConfig(max_model_len=256, block_size=block_size,
                                kv_cache_memory_bytes=32 * 16 * BYTES_PER_TOKEN),
                   offload=OffloadConfig(disk_dir=disk_dir, disk_bytes=64 << 20))
connector = engine.offload
request = engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0,
                                                         ignore_eos=True))
while engine.has_unfinished_requests():
    outs = engine.step()
connector.shutdown(flush=True)
print(json.dumps({"tokens": outs[-1].outputs[0].token_ids, "cached": request.num_cached_tokens,
                  "disk_hits": connector.offload.stats()["disk"].hits}))
""".replace("BYTES_PER_TOKEN", str(BYTES_PER_TOKEN))


def _run_process(disk_dir, block_size: int, prompt: list[int]) -> dict:
    done = subprocess.run([sys.executable, "-c", _RESTART_SCRIPT, str(disk_dir), str(block_size),
                           json.dumps(prompt)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_disk_tier_survives_restart_only_for_the_same_layout(tmp_path):
    rng = random.Random(11)
    prompt = [rng.randrange(100, 40000) for _ in range(100)]
    first = _run_process(tmp_path, 16, prompt)
    assert first["cached"] == 0 and first["disk_hits"] == 0
    second = _run_process(tmp_path, 16, prompt)
    assert second["cached"] == 6 * 16 and second["disk_hits"] == 6
    assert second["tokens"] == first["tokens"]
    other = _run_process(tmp_path, 32, prompt)  # another block size: another namespace
    assert other["cached"] == 0 and other["disk_hits"] == 0
    assert other["tokens"] == first["tokens"]


@dataclass
class FailNthRead(Faults):
    """Fails exactly the ``fail_at``-th block read from a tier (1-based) with EIO."""

    fail_at: int = 1
    reads: int = 0

    def before_read(self) -> None:
        self.reads += 1
        if self.reads == self.fail_at:
            raise OSError(errno.EIO, "injected read error")


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """A tiny qwen2 (layer 0 full attention, layer 1 a sliding window of 8 tokens) in a
    16-block pool: prompt a, prompt b (which evicts a), then a again. Returns a function
    running that sequence, with offloading when given faults, and the reference (no
    offloading) outputs."""
    model = str(make_tiny_checkpoint(tmp_path_factory.mktemp("offload-hybrid"), "qwen2"))
    rng = random.Random(5)
    a, b = ([rng.randrange(0, 256) for _ in range(100)] for _ in range(2))
    prompts = [("a", a), ("b", b), ("a-again", a)]

    def run(faults: Faults | None):
        offload = OffloadConfig(cpu_bytes=16 << 20) if faults is not None else None
        engine = make_engine(num_blocks=8, max_model_len=112, model=model,
                             bytes_per_token=TINY_BYTES_PER_TOKEN, offload=offload,
                             faults=faults or NO_FAULTS)
        connector = engine.offload
        try:
            results = []
            for rid, p in prompts:
                results.append(run_one(engine, rid, p))
                if connector is not None:
                    # Stores (of evicted blocks) still in flight are not found by a lookup:
                    # finish them so the counts below do not depend on thread timing.
                    connector.offload.drain()
            usage = engine.kv_usage()
            stats = connector.stats()["cpu"] if connector is not None else None
        finally:
            if connector is not None:
                connector.shutdown()
        return results, stats, usage

    reference, _, _ = run(None)
    assert reference[2][0].num_cached_tokens == 0  # the device pool alone lost prompt a
    return run, [out.outputs[0].token_ids for _, out in reference]


def test_hybrid_prompt_comes_back_from_cpu_tier(hybrid_run):
    run, expected = hybrid_run
    results, cpu, usage = run(Faults())
    assert [out.outputs[0].token_ids for _, out in results] == expected
    # 99 tokens may be skipped: 6 blocks. Full attention needs all 6, the window only the
    # 6th, so at most 7 blocks come from the tier (the rest are still in the pool).
    assert results[2][0].num_cached_tokens == 6 * 16
    assert 0 < cpu.hits <= 7 and cpu.failed_loads == 0
    assert cpu.bytes_loaded == cpu.hits * 16 * TINY_BYTES_PER_TOKEN // 2  # one layer a block
    assert usage.used == 0 and usage.held == 0


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_hybrid_failed_load_still_gives_exact_tokens(hybrid_run, fail_at):
    """The fail_at-th block read fails. Reads go in block order: full attention's blocks
    0..4, then the window's block 5 (full attention's block 5 is still in the pool). The
    blocks read before the failure are kept and the hit is looked up again: the longest
    length valid for both groups is ``fail_at - 1`` blocks (the window's block before it is
    in the tier too), loaded again; the rest is recomputed."""
    run, expected = hybrid_run
    results, cpu, usage = run(FailNthRead(fail_at=fail_at))
    assert [out.outputs[0].token_ids for _, out in results] == expected
    assert cpu.failed_loads == 1
    assert results[2][0].num_cached_tokens == (fail_at - 1) * 16
    assert usage.used == 0 and usage.held == 0


def test_disk_tier_is_keyed_by_the_weights_not_the_model_path(tmp_path, monkeypatch, caplog):
    """Two random checkpoints reached by the same relative path share one disk directory:
    the second must not read the first's KV, and gives its own no-offload tokens. Then the
    first's block files are copied over the second's (a restore or a sync tool mixing the
    namespaces), and one of the second's is replaced by a FIFO while its engine runs: each
    is a failed load that is counted and logged, and the tokens do not change."""
    for name, seed in (("a", 1), ("b", 2)):
        make_tiny_checkpoint(tmp_path / name, "llama", seed=seed)
    prompt = list(range(40, 90))
    disk = OffloadConfig(disk_dir=str(tmp_path / "tier"), disk_bytes=64 << 20)

    def run(where: str, offload: bool, damage=lambda engine: None):
        monkeypatch.chdir(tmp_path / where)
        engine = make_engine(num_blocks=16, max_model_len=128, model="tiny-llama",
                             bytes_per_token=TINY_BYTES_PER_TOKEN,
                             offload=disk if offload else None)
        connector = engine.offload
        try:
            damage(engine)
            request, out = run_one(engine, "r", prompt)
            stats = connector.stats()["disk"] if connector else None
        finally:
            if connector is not None:
                connector.shutdown(flush=True)
        return (request.num_cached_tokens, stats.hits if stats else 0,
                out.outputs[0].token_ids), stats

    run("a", offload=True)
    assert run("a", offload=True)[0][:2] == (48, 3)  # the same weights do reuse the tier
    [ns_a] = (tmp_path / "tier").iterdir()
    expected = run("b", offload=False)[0][2]
    assert run("b", offload=True)[0] == (0, 0, expected)
    [ns_b] = set((tmp_path / "tier").iterdir()) - {ns_a}

    for source in ns_a.glob("*/*.kvb"):
        (ns_b / source.parent.name / source.name).write_bytes(source.read_bytes())
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        (cached, hits, tokens), stats = run("b", offload=True)
    assert (tokens, stats.failed_loads) == (expected, 1)
    assert "belongs to another tier" in caplog.text

    run("b", offload=True)  # b's own blocks again

    def fifo_in_place_of_the_second_block(engine):
        path = engine.offload.offload.disk.path_of(
            key_name((0, hash_request_tokens(prompt, 16)[1])))
        path.unlink()
        os.mkfifo(path)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        (cached, hits, tokens), stats = run("b", offload=True,
                                            damage=fifo_in_place_of_the_second_block)
    assert (cached, tokens, stats.failed_loads) == (16, expected, 1)
    assert "not a regular file" in caplog.text


def test_tier_misses_count_every_block_past_the_pool_hit(tmp_path, tiny_model):
    """Engine stats: each block past the device pool's hit (before the prompt's last token)
    that a tier does not hold is a miss there; one loaded from the CPU tier is a CPU hit and
    is not looked up on disk."""
    rng = random.Random(7)
    a, b = ([rng.randrange(0, 256) for _ in range(100)] for _ in range(2))
    engine = make_engine(num_blocks=8, max_model_len=112, model=tiny_model,
                         bytes_per_token=TINY_BYTES_PER_TOKEN,
                         offload=OffloadConfig(cpu_bytes=16 << 20, disk_bytes=16 << 20,
                                               disk_dir=str(tmp_path)))
    connector = engine.offload

    def counts() -> dict[str, tuple[int, int]]:
        connector.offload.drain()
        return {t: (s.hits, s.misses) for t, s in engine.snapshot().offload.items()}

    try:
        run_one(engine, "a", a)
        assert counts() == {"cpu": (0, 6), "disk": (0, 6)}  # 99 // 16 blocks looked up
        run_one(engine, "b", b)
        assert counts() == {"cpu": (0, 12), "disk": (0, 12)}
        request, _ = run_one(engine, "a-again", a)
        assert request.num_cached_tokens == 96
        assert counts() == {"cpu": (6, 12), "disk": (0, 12)}
    finally:
        connector.shutdown()


@pytest.mark.parametrize("min_load_tokens", [96, 97])
def test_a_tier_hit_under_the_break_even_length_is_recomputed(tiny_model, min_load_tokens):
    """``min_load_tokens``: a tier hit of 96 tokens loads at 96 and is recomputed at 97 (a
    short hit in its tier, neither hit nor miss); the tokens are the same either way."""
    rng = random.Random(7)
    a, b = ([rng.randrange(0, 256) for _ in range(100)] for _ in range(2))
    engine = make_engine(num_blocks=8, max_model_len=112, model=tiny_model,
                         bytes_per_token=TINY_BYTES_PER_TOKEN,
                         offload=OffloadConfig(cpu_bytes=16 << 20,
                                               min_load_tokens=min_load_tokens))
    connector = engine.offload
    try:
        _, first = run_one(engine, "a", a)
        run_one(engine, "b", b)  # evicts a's blocks from the pool
        connector.offload.drain()
        request, again = run_one(engine, "a-again", a)
        cpu = engine.snapshot().offload["cpu"]
        loaded = min_load_tokens <= 96
        assert request.num_cached_tokens == (96 if loaded else 0)
        assert (cpu.hits, cpu.short_hits, cpu.misses) == ((6, 0, 12) if loaded else (0, 6, 12))
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        connector.shutdown()


def test_the_break_even_length_is_a_whole_number_of_tokens():
    with pytest.raises(ConfigError, match="--offload-min-load-tokens must be a whole number"):
        OffloadConfig(cpu_bytes=1 << 20, min_load_tokens=-1)
    with pytest.raises(ConfigError, match="--offload-min-load-tokens"):
        EngineConfig(cpu_offload_gib=1, offload_min_load_tokens=1.5).offload_config()
    assert "hits under 512 tokens recomputed" in OffloadConfig(
        cpu_bytes=1 << 30, min_load_tokens=512).describe()


def test_preempted_request_resumes_from_the_cpu_tier(tiny_model):
    """Two requests outgrow an 8-block pool: the newer is preempted, its blocks are offered
    to the CPU tier at once, the older one's growth evicts them from the pool, and the
    preempted request loads them back and gives the tokens it gives alone."""
    rng = random.Random(9)
    prompts = {rid: [rng.randrange(0, 256) for _ in range(40)] for rid in ("a", "b")}
    params = SamplingParams(max_tokens=60, **GREEDY)

    def engine_for(num_blocks: int, offload: OffloadConfig | None = None) -> LLMEngine:
        return make_engine(num_blocks=num_blocks, max_model_len=112, model=tiny_model,
                           bytes_per_token=TINY_BYTES_PER_TOKEN, offload=offload)

    alone = engine_for(16)
    expected = {rid: run_one(alone, rid, p, max_tokens=60)[1].outputs[0].token_ids
                for rid, p in prompts.items()}
    engine = engine_for(8, OffloadConfig(cpu_bytes=16 << 20))
    connector = engine.offload
    try:
        requests = {rid: engine.add_request(rid, p, params) for rid, p in prompts.items()}
        b, offered, outputs = requests["b"], None, {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
            if b.num_preemptions and offered is None:
                connector.offload.drain()
                full = engine.kv_cache_manager.request_block_hashes(b, (b.num_tokens - 1) // 16)
                offered = [connector.offload.contains((0, h)) for h in full]
        assert offered and all(offered)
        assert {rid: o.outputs[0].token_ids for rid, o in outputs.items()} == expected
        assert connector.stats()["cpu"].hits > 0
    finally:
        connector.shutdown()


def test_identity_changes_with_the_model_dtype_and_the_layout(tiny_model):
    """Through the real identity builder: another model dtype or tensor-parallel layout
    names another disk namespace."""
    import torch

    from kvmem.engine.offload_setup import tier_identity

    engine = make_engine(num_blocks=8, max_model_len=64, model=tiny_model,
                         bytes_per_token=TINY_BYTES_PER_TOKEN)
    layers = [engine.spec.num_layers]
    base = tier_identity(engine.spec, engine.dtype, tiny_model, tensor_parallel_size=1,
                         partition=layers)
    assert tier_identity(engine.spec, torch.bfloat16, tiny_model, tensor_parallel_size=1,
                         partition=layers)[0] != base[0]
    other = tier_identity(engine.spec, engine.dtype, tiny_model, tensor_parallel_size=2,
                          partition=layers)
    assert other[0] == base[0] and other[1] != base[1]


def test_a_long_prompt_comes_back_from_a_disk_tier_with_fewer_staging_rows(tmp_path,
                                                                          tiny_model):
    """The benchmark's sequence (fill, two prompts that evict it from a pool holding one,
    the first prompt again) with a disk-only tier whose staging rows carry 2 of the
    prompt's 12 blocks at a time: every block reaches the disk, and the reload is served
    from it with the tokens a recompute gives."""
    rng = random.Random(11)
    prompt, *evictors = ([rng.randrange(0, 256) for _ in range(200)] for _ in range(3))
    block_nbytes = 16 * TINY_BYTES_PER_TOKEN
    engine = make_engine(num_blocks=15, max_model_len=216, model=tiny_model,
                         bytes_per_token=TINY_BYTES_PER_TOKEN,
                         offload=OffloadConfig(disk_bytes=16 << 20, disk_dir=str(tmp_path),
                                               staging_bytes=2 * block_nbytes))
    connector = engine.offload
    try:
        _, first = run_one(engine, "fill", prompt)
        connector.offload.drain()
        for i, evictor in enumerate(evictors):
            run_one(engine, f"evict{i}", evictor)
            connector.offload.drain()
        request, again = run_one(engine, "again", prompt)
        disk = connector.stats()["disk"]
        assert request.num_cached_tokens == 192 and disk.loaded_blocks == 12
        assert disk.skipped_stores == 0 and disk.stored_blocks == 36
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert connector.offload.engine.staging.num_free == 2
    finally:
        connector.shutdown()


_INSTANCE_SCRIPT = """
import json, sys
from kvmem.engine.config import EngineConfig
from kvmem.errors import ConfigError
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams
from kvmem.tiers import OffloadConfig

model, disk_dir, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = LLMEngine(EngineConfig(model=model, max_model_len=256, max_num_batched_tokens=512,
                                kv_cache_memory_bytes=32 * 16 * BYTES_PER_TOKEN),
                   offload=OffloadConfig(disk_dir=disk_dir, disk_bytes=64 << 20))
print("ready", flush=True)
sys.stdin.readline()  # the other instance has served the prompt
request = engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0,
                                                         ignore_eos=True))
while engine.has_unfinished_requests():
    outs = engine.step()
engine.offload.shutdown(flush=True)
print(json.dumps({"tokens": outs[-1].outputs[0].token_ids, "cached": request.num_cached_tokens,
                  "disk_hits": engine.offload.offload.stats()["disk"].hits}), flush=True)
""".replace("BYTES_PER_TOKEN", str(TINY_BYTES_PER_TOKEN))


def test_a_running_instance_reloads_the_blocks_another_instance_wrote(tmp_path, tiny_model):
    """Two engines (two processes) of one model share a disk directory; B starts first,
    so its start-up scan finds nothing. A serves a prompt and writes its blocks; B's
    first request for it then loads them (found by name on disk), with A's tokens."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 250) for _ in range(100)]
    args = [sys.executable, "-c", _INSTANCE_SCRIPT, tiny_model, str(tmp_path / "tier"),
            json.dumps(prompt)]
    b = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert b.stdout.readline().strip() == "ready"
        a = subprocess.run(args, input="\n", capture_output=True, text=True, timeout=300)
        assert a.returncode == 0, a.stderr
        first = json.loads(a.stdout.strip().splitlines()[-1])
        out, _ = b.communicate("\n", timeout=300)
    finally:
        b.kill()
    second = json.loads(out.strip().splitlines()[-1])
    assert first["cached"] == 0 and first["disk_hits"] == 0
    assert second["cached"] == 6 * 16 and second["disk_hits"] == 6
    assert second["tokens"] == first["tokens"]
