"""Offloading as a user turns it on: ``kvmem serve``/``generate`` flags (one process and
tensor parallel), the tiers' counters on /metrics, and one-line errors for bad settings."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import start_server, stop_server
from test_tiers import plant_damage
from tiny_models import make_tiny_checkpoint

from kvmem.engine.llm_engine import EngineSnapshot
from kvmem.serve.metrics import make_registry
from kvmem.tiers import TierStats
from kvmem.tiers.stats import COUNTERS, FAILED_LOAD_CAUSES, GAUGES

# tiny llama: 2 layers, 2 KV heads of dim 16, fp32; with tp 2 a rank holds one head
RANK_BLOCK_BYTES = 16 * 2 * 1 * 16 * 4 * 2  # 16 tokens, K and V, 1 head, dim 16, fp32, 2 layers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("offload-cli"), "llama")


def kvmem(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvmem", *args], env=env, capture_output=True,
                          text=True, timeout=180)


def scrape(base: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def snapshot(prefill_rate: float | None = None, **offload: TierStats) -> EngineSnapshot:
    return EngineSnapshot(received_requests=0, finished_requests={}, failed_requests={},
                          prompt_tokens=0, generation_tokens=0, steps=0, num_preemptions=0,
                          num_running=0,
                          num_waiting=0, kv_blocks_total=8, kv_blocks_free=8, kv_blocks_used=0,
                          kv_blocks_cached=0, prefix_queried_tokens=0, prefix_hit_tokens=0,
                          offload=offload, prefill_rate=prefill_rate)


def distinct_stats(base: int, **fixed) -> TierStats:
    """A TierStats whose every number differs from the others (and from another base's)."""
    names = [f.name for f in dataclasses.fields(TierStats)
             if f.name not in ("failed_load_causes", "enabled")]
    return TierStats(**{n: base + i for i, n in enumerate(names)}, **fixed)


def test_metrics_export_every_tier_figure_under_its_shared_name():
    """Every TierStats figure is on /metrics as kvmem_offload_<field> with its tier label
    (counters as _total), failed loads once per cause, and the measured prefill rate: the
    names vLLM's /metrics shows for KvmemConnector (kvmem.tiers.stats)."""
    cpu = distinct_stats(100, failed_load_causes={"missing": 2, "io": 3})
    disk = distinct_stats(200, failed_load_causes={"checksum": 5}, enabled=False)
    text = generate_latest(make_registry(lambda: snapshot(1234.5, cpu=cpu, disk=disk),
                                         "m")).decode()
    values = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
              for family in text_string_to_metric_families(text) for sample in family.samples}
    for tier, stats in (("cpu", cpu), ("disk", disk)):
        label = (("model_name", "m"), ("tier", tier))
        for field in COUNTERS:
            if field == "failed_loads":
                for cause in FAILED_LOAD_CAUSES:
                    key = ("kvmem_offload_failed_loads_total", (("cause", cause), *label))
                    assert values.pop(key) == stats.failed_load_causes.get(cause, 0)
            else:
                assert values.pop((f"kvmem_offload_{field}_total", label)) == \
                    getattr(stats, field)
        for field in GAUGES:
            assert values.pop((f"kvmem_offload_{field}", label)) == float(getattr(stats, field))
    assert values.pop(("kvmem_prefill_tokens_per_second", (("model_name", "m"),))) == 1234.5
    assert not [k for k in values if k[0].startswith(("kvmem_offload", "kvmem_prefill"))]


def test_metrics_without_offload_have_no_tier_series():
    text = generate_latest(make_registry(lambda: snapshot(), "m")).decode()
    assert "kvmem_offload_" not in text and "kvmem_kv_blocks_total" in text


@pytest.mark.slow
def test_serve_with_tensor_parallel_and_cpu_offload_reloads_an_evicted_prompt(model_dir):
    """`kvmem serve -tp 2 --cpu-offload-gib`: a prompt pushed out of a 14-block pool by
    another comes back from the CPU tier with the same tokens, and /metrics counts it."""
    proc, base = start_server(model_dir, "-tp", "2", "--cpu-offload-gib", "0.01",
                              "--max-num-batched-tokens", "64", "--max-model-len", "192",
                              "--kv-cache-memory-bytes", str(14 * RANK_BLOCK_BYTES))
    try:
        first = "".join(chr(97 + i % 26) for i in range(150))
        second = "".join(chr(90 - i % 26) for i in range(150))

        def complete(prompt: str) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()

        before = scrape(base)
        outs = [complete(p) for p in (first, second, first)]
        after = scrape(base)
        assert outs[2]["choices"][0]["text"] == outs[0]["choices"][0]["text"]
        cpu = '{model_name="tiny",tier="cpu"}'
        hits = after[f"kvmem_offload_hits_total{cpu}"] - before[f"kvmem_offload_hits_total{cpu}"]
        assert hits >= 1
        loaded = after[f"kvmem_offload_bytes_loaded_total{cpu}"]
        assert loaded == hits * 2 * RANK_BLOCK_BYTES  # a host row holds both ranks' halves
        assert after[f"kvmem_offload_stored_blocks_total{cpu}"] >= 9
        assert after[f"kvmem_offload_capacity_bytes{cpu}"] > 0
        # the figures vLLM shows for KvmemConnector, under the same names
        loaded = after[f"kvmem_offload_loaded_blocks_total{cpu}"]
        assert loaded == hits and after[f"kvmem_offload_hit_tokens_total{cpu}"] == 16 * hits
        assert after[f"kvmem_offload_lookups_total{cpu}"] == \
            after[f"kvmem_offload_hits_total{cpu}"] + after[f"kvmem_offload_misses_total{cpu}"]
        assert after[f"kvmem_offload_load_seconds_total{cpu}"] > 0
        assert after[f"kvmem_offload_store_seconds_total{cpu}"] > 0
        rate = after['kvmem_prefill_tokens_per_second{model_name="tiny"}']
        assert after[f"kvmem_offload_prefill_saved_seconds_total{cpu}"] > 0 and rate > 0
    finally:
        assert stop_server(proc) == 0


@pytest.mark.slow
def test_generate_with_a_disk_tier_writes_blocks_that_a_second_run_reuses(model_dir, tmp_path):
    """The flags reach the engine; queued stores are written out when `kvmem generate`
    exits, under a namespace with its identity; a second run prints the same text."""
    prompt = "the quick brown fox jumps over the lazy dog " * 3  # 132 bytes: 8 full blocks
    common = ["generate", prompt, "--model", str(model_dir), "--max-tokens", "5", "--ignore-eos",
              "--max-model-len", "192", "--kv-cache-memory-bytes", "1MiB"]
    plain = kvmem(*common)
    assert plain.returncode == 0, plain.stderr
    tier = tmp_path / "tier"
    flags = ["--disk-offload-dir", str(tier), "--disk-offload-gib", "0.01"]
    runs = [kvmem(*common, *flags) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert run.stdout == plain.stdout
    (namespace,) = tier.glob("kvmem-*")
    assert (namespace / "identity.json").is_file()
    assert len(list(namespace.glob("*/*.kvb"))) >= 8


@pytest.mark.slow
def test_serve_starts_over_damaged_disk_tier_entries(model_dir, tmp_path):
    """Directories and links named like the disk tier's files (which used to stop `kvmem
    serve` at start-up with a traceback) are skipped and counted; the blocks an earlier
    run wrote are still served from disk."""
    prompt = "the quick brown fox jumps over the lazy dog " * 3  # 8 full blocks
    sizes = ["--max-model-len", "192", "--kv-cache-memory-bytes", "1MiB"]
    tier = ["--disk-offload-dir", str(tmp_path / "tier"), "--disk-offload-gib", "0.01"]
    first = kvmem("generate", prompt, "--model", str(model_dir), "--max-tokens", "5",
                  "--ignore-eos", "--temperature", "0", *sizes, *tier)
    assert first.returncode == 0, first.stderr
    (namespace,) = (tmp_path / "tier").glob("kvmem-*")
    damaged = plant_damage(namespace, tmp_path / "outside")
    proc, base = start_server(model_dir, *sizes, *tier)
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == first.stdout[:-1]
        metrics = scrape(base)
        disk = '{model_name="tiny",tier="disk"}'
        assert metrics[f"kvmem_offload_skipped_files_total{disk}"] == len(damaged)
        assert metrics[f"kvmem_offload_hits_total{disk}"] >= 7
    finally:
        assert stop_server(proc) == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--disk-offload-gib", "1"], "needs --disk-offload-dir"),
    (["--disk-offload-dir", "/tmp/x"], "needs --disk-offload-gib"),
    (["--cpu-offload-gib", "-1"], "--cpu-offload-gib must be a non-negative"),
    (["--cpu-offload-gib", "nan"], "--cpu-offload-gib must be a non-negative"),
    (["--cpu-offload-gib", "100000"], "of memory available on this machine"),
    (["--disk-offload-dir", "/tmp/kvmem-never-made", "--disk-offload-gib", "1e30"],
     "--disk-offload-gib 1e+30 exceeds the"),
])
def test_bad_offload_flags_are_one_line_exit_2(flags, message):
    res = kvmem("generate", "x", *flags)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmem: error:") and message in lines[0]


def test_tier_capacity_gauges_for_routers():
    """Per tier, used and total in bytes and in blocks, as KV-aware routers weigh tiers."""
    cpu = TierStats(used_bytes=300, capacity_bytes=1000, used_blocks=3, capacity_blocks=10)
    disk = TierStats(used_bytes=7000, capacity_bytes=9000, used_blocks=70, capacity_blocks=90)
    text = generate_latest(make_registry(lambda: snapshot(cpu=cpu, disk=disk), "m")).decode()
    values = {(s.name, s.labels["tier"], s.labels["kind"]): s.value
              for family in text_string_to_metric_families(text) for s in family.samples
              if s.name.startswith("kvmem_tier_capacity")}
    assert values == {
        ("kvmem_tier_capacity_bytes", "cpu", "used"): 300,
        ("kvmem_tier_capacity_bytes", "cpu", "total"): 1000,
        ("kvmem_tier_capacity_blocks", "cpu", "used"): 3,
        ("kvmem_tier_capacity_blocks", "cpu", "total"): 10,
        ("kvmem_tier_capacity_bytes", "disk", "used"): 7000,
        ("kvmem_tier_capacity_bytes", "disk", "total"): 9000,
        ("kvmem_tier_capacity_blocks", "disk", "used"): 70,
        ("kvmem_tier_capacity_blocks", "disk", "total"): 90,
    }


@pytest.mark.slow
def test_two_serve_instances_share_one_disk_tier(model_dir, tmp_path):
    """Two `kvmem serve` instances of one model on one disk directory, both running: B's
    first request for a prompt A served loads A's blocks (same text), and both instances'
    capacity gauges count the namespace's blocks, A's included."""
    flags = ["--disk-offload-dir", str(tmp_path / "tier"), "--disk-offload-gib", "0.01",
             "--max-model-len", "192"]
    servers = [start_server(model_dir, *flags) for _ in range(2)]
    try:
        (_, a), (_, b) = servers
        prompt = "".join(chr(97 + i % 26) for i in range(150))  # 9 full blocks past the first
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        first = httpx.post(f"{a}/v1/completions", json=body, timeout=120).json()
        disk = '{model_name="tiny",tier="disk"}'
        deadline = time.monotonic() + 60
        while scrape(a)[f"kvmem_offload_stored_blocks_total{disk}"] < 9:
            assert time.monotonic() < deadline, "A's blocks were not written"
            time.sleep(0.2)
        second = httpx.post(f"{b}/v1/completions", json=body, timeout=120).json()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        after = scrape(b)
        assert after[f"kvmem_offload_hits_total{disk}"] == 9
        for base in (a, b):
            used = scrape(base)['kvmem_tier_capacity_blocks{kind="used",model_name="tiny",'
                                'tier="disk"}']
            assert used == 9
    finally:
        for proc, _ in servers:
            assert stop_server(proc) == 0
