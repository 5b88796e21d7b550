"""Memory profiles: the report arithmetic (MISSION.md problem 5's example), the CPU
measurements of the embedded model, `kvmem plan --profile`, and an engine started with
the suggested kv_cache_memory_bytes allocating exactly the blocks the plan predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from math import ceil
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from kvmem.cli import main
from kvmem.engine.config import EngineConfig
from kvmem.engine.cuda_graphs import capture_sizes
from kvmem.engine.memory_profile import PROFILE_HEADROOM_BYTES, MemoryProfile
from kvmem.engine.models import onednn_gemm
from kvmem.engine.profile_ranks import profile_memory
from kvmem.engine.profiler import CPUMeter, cuda_graphs_enabled
from kvmem.errors import ConfigError
from kvmem.units import GiB, MiB

# small enough for the shared 2-core test machine, large enough that every peak is visible
SETTINGS = dict(max_model_len=512, max_num_batched_tokens=512, max_num_seqs=64)


def gib(x: float) -> int:
    return round(x * GiB)


def mission_example(**overrides) -> MemoryProfile:
    """gemma-3-4b-it on one GPU, as logged (MISSION.md problem 5); figures rounded to 0.01 GiB."""
    values = dict(model="google/gemma-3-4b-it", device="cuda:0", total_bytes=gib(178.36),
                  free_bytes_at_start=gib(177.66), gpu_memory_utilization=0.9,
                  weights_bytes=gib(8.58), forward_peak_bytes=gib(9.96), sampler_peak_bytes=0,
                  non_torch_bytes=gib(0.07), cuda_graph_bytes=gib(0.65),
                  cuda_graph_sizes=[1, 2, 4, 8])
    return MemoryProfile(**{**values, **overrides})


# six inputs, each rounded to 0.01 GiB in the log: at most 6 x 0.005 GiB of difference
ROUNDING = gib(0.03)


def test_report_arithmetic_reproduces_the_mission_example():
    p = mission_example()
    assert abs(p.requested_bytes - gib(160.53)) <= gib(0.01)
    assert abs(p.suggested_kv_bytes_fit - 151_519_866_880) <= ROUNDING
    assert abs(p.suggested_kv_bytes_whole - 169_914_314_752) <= ROUNDING
    # "whole GPU" starts from the memory free at start, not from the device total ...
    from_total = p.total_bytes - p.non_kv_bytes - p.headroom_bytes
    assert abs(from_total - 169_914_314_752) > gib(0.5)
    # ... and both suggestions keep the 150 MiB headroom: without it they miss by 0.15 GiB
    assert abs(p.suggested_kv_bytes_fit + PROFILE_HEADROOM_BYTES - 151_519_866_880) > ROUNDING
    text = p.summary()
    for part in ("free 177.66 of 178.36 GiB", "utilisation 0.9 requests 160.52 GiB",
                 "weights 8.58 GiB", "peak activation 9.96 GiB", "non-torch 0.07 GiB",
                 "CUDA graphs 0.65 GiB", f"{p.suggested_kv_bytes_fit:,} bytes to fit"):
        assert part in text


def test_summary_warns_when_the_fit_value_exceeds_the_free_memory():
    """Another process holds 40 GiB of the 178.36: utilisation 0.9 requests more than was
    free, so the fit value would not fit and the report says so."""
    assert "Warning" not in mission_example().summary()
    p = mission_example(free_bytes_at_start=gib(138.36))
    assert p.suggested_kv_bytes_fit > p.suggested_kv_bytes_whole
    assert ("Warning: utilisation 0.9 requests 160.52 GiB but only 138.36 GiB was free at "
            "start") in p.summary()


def test_activation_is_the_larger_of_forward_and_sampler_peaks():
    assert mission_example(sampler_peak_bytes=gib(11)).activation_bytes == gib(11)
    assert mission_example(sampler_peak_bytes=gib(1)).activation_bytes == gib(9.96)


def test_suggestions_never_go_negative():
    p = mission_example(weights_bytes=gib(200))
    assert p.suggested_kv_bytes_fit == 0 and p.suggested_kv_bytes_whole == 0


def test_json_round_trip_and_bad_files(tmp_path):
    p = mission_example()
    path = tmp_path / "p.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["derived"]["suggested_kv_bytes_fit"] == p.suggested_kv_bytes_fit
    assert MemoryProfile.load(path) == p
    for bad, why in (({"format": "other"}, "not a kvmem memory profile"),
                     ({**data, "weights_bytes": -1}, "weights_bytes must be a non-negative"),
                     ({**data, "gpu_memory_utilization": 1.5}, "(0, 1]"),
                     ({"format": data["format"], "model": "x"}, "incomplete")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace("]", r"\]")):
            MemoryProfile.load(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        MemoryProfile.load(path)


def test_to_rank_profile_carries_the_measured_figures():
    r = mission_example(sampler_peak_bytes=gib(12)).to_rank_profile()
    # the planner keeps no headroom of its own: it travels with the non-torch figure
    assert (r.weights_bytes, r.activation_bytes, r.non_torch_bytes, r.cuda_graph_bytes,
            r.total_bytes) == (gib(8.58), gib(12), gib(0.07) + 150 * MiB, gib(0.65),
                               gib(178.36))


# ------------------------------------------------------------------ CPU measurement
def test_cpu_meter_sees_an_allocation_at_its_peak():
    """With /proc/self/clear_refs the meter reads the kernel's high-water mark of resident
    memory (VmHWM), reset just before: it holds every page of an allocation touched and
    freed inside, however briefly it lived, less pages the kernel took back from the
    process meanwhile (file-backed ones, on a machine short of memory: 36 KiB in one loaded
    CI run) and plus what else grew; the bounds allow for both."""
    import kvmem.engine.profiler as profiler

    if not profiler._reset_high_water_mark():
        pytest.skip("/proc/self/clear_refs is not writable here (the sampling test covers it)")
    meter = CPUMeter(torch.device("cpu"))
    meter.start()
    size = 64 * MiB

    def allocate() -> None:
        torch.ones(size // 4, dtype=torch.float32)  # touched, then freed before returning

    peak = meter.peak(allocate)
    assert size * 0.9 <= peak < size + 32 * MiB


def test_cpu_meter_falls_back_to_sampling(monkeypatch):
    """Without clear_refs the meter samples the resident size on a thread: it sees an
    allocation that lives while a sample is taken (however long the thread takes to be
    scheduled on a loaded machine), so the allocation here is held until two samples
    have started after it."""
    import kvmem.engine.profiler as profiler

    monkeypatch.setattr(profiler, "_reset_high_water_mark", lambda: False)
    samples = []
    rss = profiler._rss

    def counted_rss() -> int:
        samples.append(None)
        return rss()

    monkeypatch.setattr(profiler, "_rss", counted_rss)
    meter = CPUMeter(torch.device("cpu"))
    meter.start()
    size = 64 * MiB

    def allocate_and_hold() -> None:
        x = torch.ones(size // 4, dtype=torch.float32)
        seen = len(samples)
        while len(samples) < seen + 2:  # the second began after the first ended
            time.sleep(0.001)
        del x

    assert size * 0.9 <= meter.peak(allocate_and_hold) < size + 32 * MiB


@pytest.fixture(scope="module")
def embedded_profile(tmp_path_factory) -> MemoryProfile:
    """`kvmem profile` in its own process, as users run it: resident-memory figures taken
    inside the test process would include what earlier tests left in its heap."""
    out = tmp_path_factory.mktemp("profile") / "smollm2.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    # One GEMM backend whatever the load: the choice is timed at start-up and can flip on a
    # busy machine, and MKL's packed buffers on CPUs not made by Intel are resident beyond
    # the weights' own bytes (1.57x on an AMD EPYC), which this test does not measure.
    env = dict(os.environ)
    if onednn_gemm.available():
        env["KVMEM_CPU_GEMM"] = "onednn"
    subprocess.run([sys.executable, "-m", "kvmem", "profile", "--device", "cpu", *flags,
                    "--output", str(out)], check=True, capture_output=True, timeout=600,
                   env=env)
    return MemoryProfile.load(out)


def test_cpu_profile_of_the_embedded_model_measures_every_component(embedded_profile):
    p = embedded_profile
    params = 134_515_008  # SmolLM2-135M: 30 layers, hidden 576, vocab 49,152, tied embeddings
    assert p.device == "cpu" and p.dtype == "float32"
    assert p.weights_bytes >= 4 * params
    # the parameters are really resident: loading them grew the process by about as much
    assert 0.8 * p.weights_bytes <= p.weights_resident_bytes <= 1.5 * p.weights_bytes
    # a forward of 512 tokens holds at least its 512 x 576 fp32 hidden states and
    # 512 x 1,536 MLP intermediates; the sampler at least 64 x 49,152 fp32 logits
    assert p.forward_peak_bytes > 512 * (576 + 1536) * 4
    assert p.sampler_peak_bytes > 64 * 49_152 * 4
    assert p.non_torch_bytes > 50 * MiB  # interpreter, torch, tokenizer
    assert 0 < p.free_bytes_at_start <= p.total_bytes
    # CUDA graphs are absent on CPU, not missing from the measurement
    assert p.cuda_graph_bytes == 0 and p.cuda_graph_sizes == []
    assert "not captured (CPU)" in p.summary()


def test_cpu_profile_arithmetic_against_hand_computed_figures():
    """A CPU profile of round figures, its budgets worked out by hand: requested 8 GiB of
    16 GiB, non-KV 1,024 + 300 + 250 = 1,574 MiB (the forward peak, not the sampler's)."""
    p = MemoryProfile(model="m", device="cpu", total_bytes=16 * GiB, free_bytes_at_start=10 * GiB,
                      gpu_memory_utilization=0.5, weights_bytes=1 * GiB,
                      forward_peak_bytes=300 * MiB, sampler_peak_bytes=200 * MiB,
                      non_torch_bytes=250 * MiB, cuda_graph_bytes=0)
    assert p.requested_bytes == 8192 * MiB
    assert p.non_kv_bytes == 1574 * MiB
    assert p.suggested_kv_bytes_fit == 6468 * MiB  # 8,192 - 1,574 - 150
    assert p.suggested_kv_bytes_whole == 8516 * MiB  # 10,240 - 1,574 - 150
    # the request is rounded up to a whole byte: ceil(1,001 x 0.5) = 501
    assert replace(p, total_bytes=1001).requested_bytes == 501


def _plan_json(capsys, argv) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_engine_with_the_suggested_budget_allocates_the_planned_blocks(
        embedded_profile, tmp_path, capsys):
    from kvmem.engine.llm_engine import LLMEngine

    # a utilisation that leaves a small KV budget (about 48 MiB) on this machine
    p = embedded_profile
    util = (p.non_kv_bytes + p.headroom_bytes + 48 * MiB) / p.total_bytes
    p = p.with_utilization(util)
    fit = p.suggested_kv_bytes_fit
    assert 40 * MiB < fit < 56 * MiB
    path = tmp_path / "profile.json"
    p.save(path)
    common = ["plan", p.checkpoint, "--profile", str(path), "--kv-cache-dtype", p.dtype,
              "--max-model-len", "512", "--max-num-seqs", "64", "--max-num-batched-tokens",
              "512", "--gpu-memory-utilization", repr(util)]
    # the plan with the measured figures leaves exactly the fit value
    measured = _plan_json(capsys, common)
    rank = measured["ranks"][0]
    assert rank["weights_bytes"] == p.weights_bytes
    assert rank["activation_bytes"] == p.activation_bytes
    assert rank["non_torch_bytes"] == p.non_torch_bytes + p.headroom_bytes
    assert rank["cuda_graph_bytes"] == 0
    assert rank["kv_budget_bytes"] == fit
    explicit = _plan_json(capsys, common + ["--kv-cache-memory-bytes", str(fit)])
    predicted = explicit["engine"]["num_blocks"]
    assert predicted > 0

    engine = LLMEngine(EngineConfig(model=None, device="cpu", kv_cache_memory_bytes=fit,
                                    **SETTINGS))
    assert engine.num_blocks == predicted
    assert engine.memory_profile is None  # an explicit budget skips profiling
    assert engine.kv_storage.num_blocks * explicit["ranks"][0]["bytes_per_block"] <= fit


# ------------------------------------------------------------------ the command
def test_profile_command_json_and_report(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path)
    out = tmp_path / "tiny.json"
    argv = ["profile", str(model), "--device", "cpu", "--max-num-batched-tokens", "128",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5"]
    assert main(argv + ["--json", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = MemoryProfile.load(out)
    assert printed["derived"]["suggested_kv_bytes_fit"] == saved.suggested_kv_bytes_fit
    assert saved.weights_bytes == sum(
        t.numel() * 4 for t in _safetensors(model / "model.safetensors").values())
    assert saved.gpu_memory_utilization == 0.5 and saved.max_num_seqs == 8

    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "not captured (CPU)" in text and "--kv-cache-memory-bytes" in text
    assert "KV budget: fit" in text and "KV budget: whole" in text


def test_profile_of_two_pipeline_stages_measures_each_rank(tmp_path, capsys):
    """`kvmem profile -pp 2 --json`: each rank loads and measures only its stage (its
    weights, a forward over its layers, the sampler only on the last stage), and `kvmem
    plan --pp 2 --profile` sizes each rank from its own measurement."""
    model = make_tiny_checkpoint(tmp_path, num_hidden_layers=4)
    out = tmp_path / "pp2.json"
    argv = ["profile", str(model), "--device", "cpu", "--max-num-batched-tokens", "128",
            "--max-num-seqs", "8", "-pp", "2"]
    assert main(argv + ["--json", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["format"] == "kvmem-memory-profiles/1"
    assert (printed["tensor_parallel_size"], printed["pipeline_parallel_size"]) == (1, 2)
    ranks = printed["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["layers"] for r in ranks] == [[0, 1], [2, 3]]
    tensors = _safetensors(model / "model.safetensors")
    layer_bytes = sum(t.numel() * 4 for name, t in tensors.items() if ".layers.0." in name)
    embed = tensors["model.embed_tokens.weight"].numel() * 4
    for r in ranks:
        assert r["weights_bytes"] >= 2 * layer_bytes  # its two layers, not all four
        assert r["weights_bytes"] < 4 * layer_bytes + 2 * embed
        assert r["forward_peak_bytes"] > 0 and r["non_torch_bytes"] > 0
    assert ranks[0]["sampler_peak_bytes"] == 0 < ranks[1]["sampler_peak_bytes"]
    from kvmem.engine.memory_profile import load_profiles

    saved = load_profiles(out)
    assert [p.weights_bytes for p in saved] == [r["weights_bytes"] for r in ranks]
    planned = _plan_json(capsys, ["plan", str(model), "--pp", "2", "--profile", str(out),
                                  "--max-num-batched-tokens", "128", "--max-num-seqs", "8"])
    for rank, p in zip(planned["ranks"], saved, strict=True):
        assert rank["weights_bytes"] == p.weights_bytes
        assert rank["activation_bytes"] == p.activation_bytes
    assert main(["plan", str(model), "--profile", str(out), "--max-num-batched-tokens", "128",
                 "--max-num-seqs", "8"]) == 2
    assert "measured the ranks of (tp 1, pp 2)" in capsys.readouterr().err


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_profile_command_errors_are_one_line(tmp_path, capsys):
    assert main(["profile", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmem: error:") and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["plan", "qwen3-8b", "--gpu", "H100", "--profile", str(bad)]) == 2
    assert "not a kvmem memory profile" in capsys.readouterr().err


@pytest.mark.parametrize("flags,says", [
    (["--kv-cache-memory-bytes", "1GiB"], "--kv-cache-memory-bytes would only be ignored"),
    (["--kv-memory", "elastic"], "does not measure --kv-memory elastic"),
    (["--cpu-offload-gib", "1"], "does not measure the KV offload tiers"),
    (["--output", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
])
def test_profile_refuses_before_loading_what_it_cannot_do(tmp_path, capsys, flags, says):
    """Settings a profile would get wrong or ignore, and an --output that could not be
    written, fail with one line and exit 2 before any weights load."""
    # the model does not exist: reaching it would fail with another message
    assert main(["profile", str(tmp_path / "not-loaded"), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmem: error:") and err.count("\n") == 1 and says in err


def test_profile_output_that_is_a_directory_or_read_only(tmp_path, capsys, monkeypatch):
    assert main(["profile", "--device", "cpu", "--output", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # root ignores directory permissions: ask os.access as an unprivileged user would
    import kvmem.cli.profile as profile_cli

    real_access = os.access
    monkeypatch.setattr(profile_cli.os, "access", lambda path, mode: (
        False if Path(path) == locked else real_access(path, mode)))
    assert main(["profile", "--device", "cpu", "--output", str(locked / "p.json")]) == 2
    assert "not writable" in capsys.readouterr().err


def test_plan_profile_replaces_the_estimates(tmp_path, capsys):
    path = tmp_path / "gemma.json"
    mission_example(cuda_graph_bytes=gib(1.3)).save(path)
    argv = ["plan", "qwen3-8b", "--max-model-len", "8192"]
    estimated = _plan_json(capsys, argv + ["--gpu-memory", "178.36"])["ranks"][0]
    measured = _plan_json(capsys, argv + ["--profile", str(path)])["ranks"][0]
    assert measured["cuda_graph_bytes"] == gib(1.3) != estimated["cuda_graph_bytes"]
    assert measured["weights_bytes"] == gib(8.58) != estimated["weights_bytes"]
    assert measured["memory_bytes"] == gib(178.36)
    assert measured["kv_budget_bytes"] == (measured["budget_bytes"] - gib(8.58) - gib(9.96)
                                           - gib(0.07) - gib(1.3) - 150 * MiB)


@pytest.mark.parametrize("flags,says", [
    (["--tp", "2"], "measured one process (tp 1, pp 1); it cannot stand for the ranks of tp 2"),
    (["--pp", "2"], "cannot stand for the ranks of tp 1 x pp 2"),
    (["--max-num-batched-tokens", "2048"], "measured with --max-num-batched-tokens 8192 but"),
    (["--max-num-seqs", "32"], "measured with --max-num-seqs 256 but the plan uses 32"),
])
def test_plan_refuses_a_profile_that_cannot_stand_for_the_plan(tmp_path, capsys, flags, says):
    """A whole-model profile applied to a tp/pp rank would count every rank's weights in
    full; one taken under other batch limits has another activation peak."""
    path = tmp_path / "p.json"
    mission_example().save(path)
    assert main(["plan", "qwen3-8b", "--profile", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmem: error:") and err.count("\n") == 1 and says in err, err


def test_suggested_fit_plan_profile_and_engine_budgets_are_one_value(
        tmp_path, capsys, monkeypatch):
    """One profile, three consumers: the fit value `kvmem profile` prints, the KV budget of
    `kvmem plan --profile`, and the budget the engine plans on a GPU from a measured
    profile (LLMEngine: plan_kv_cache with the profile's RankProfile) are the same bytes."""
    from types import SimpleNamespace

    from kvmem.engine.kv_cache_setup import plan_kv_cache
    from kvmem.spec import load_spec

    model = make_tiny_checkpoint(tmp_path)
    p = mission_example(checkpoint=str(model), max_model_len=256)
    expected = (ceil(gib(178.36) * 0.9) - gib(8.58) - gib(9.96) - gib(0.07) - gib(0.65)
                - 150 * MiB)  # requested - weights - activation - non-torch - graphs - 150 MiB
    assert p.suggested_kv_bytes_fit == expected
    path = tmp_path / "p.json"
    p.save(path)
    planned = _plan_json(capsys, ["plan", str(model), "--profile", str(path),
                                  "--max-model-len", "256"])["ranks"][0]["kv_budget_bytes"]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=p.total_bytes))
    engine_plan = plan_kv_cache(load_spec(str(model)), EngineConfig(model=str(model)),
                                device=torch.device("cuda", 0), kv_dtype="float32",
                                max_model_len=256, profile=p.to_rank_profile())
    assert planned == engine_plan.ranks[0].kv_budget_bytes == expected


# ------------------------------------------------------------------ CUDA graphs (settings)
def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 35
    assert capture_sizes(300)[-1] == 304
    assert capture_sizes(4096)[-1] == 512  # larger decode batches run eagerly


def test_cuda_graphs_need_triton_and_no_enforce_eager(tmp_path):
    from kvmem.cli import build_parser
    from kvmem.engine.loader import resolve_model
    from kvmem.engine.models import build_model

    config = resolve_model(str(make_tiny_checkpoint(tmp_path))).config
    triton_model = build_model(config, attention_backend="triton")
    reference_model = build_model(config, attention_backend="reference")
    assert cuda_graphs_enabled(EngineConfig(), triton_model)
    assert not cuda_graphs_enabled(EngineConfig(enforce_eager=True), triton_model)
    assert not cuda_graphs_enabled(EngineConfig(), reference_model)
    assert not cuda_graphs_enabled(EngineConfig(block_size=8), triton_model)
    parser, _ = build_parser(["profile"])
    args = parser.parse_args(["profile", "--enforce-eager"])
    assert EngineConfig.from_args(args).enforce_eager


class EagerReplay:
    """Stands in for a captured torch.cuda.CUDAGraph on CPU: replay runs the same forward
    over the runner's static buffers and writes the static output."""

    replays = 0

    def __init__(self, runner, batch: int) -> None:
        self.runner, self.batch = runner, batch

    @torch.inference_mode()
    def replay(self) -> None:
        EagerReplay.replays += 1
        self.runner.outputs[self.batch].copy_(self.runner._forward(self.batch))


def test_graph_runner_pads_decode_batches_into_static_buffers(tmp_path):
    """Decode steps through the runner's static buffers (3 sequences padded to 4, block
    tables and slot mappings copied in) give the same tokens as eager steps."""
    from kvmem.engine.cuda_graphs import CUDAGraphRunner
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.engine.sampling_params import SamplingParams

    model = str(make_tiny_checkpoint(tmp_path))
    prompts = [[5, 6, 7], list(range(40, 75)), [9] * 20]
    tokens = {}
    for graphs in (False, True):
        engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=128,
                                        kv_cache_memory_bytes=4 * MiB))
        runner = engine.model_runner
        if graphs:
            static = CUDAGraphRunner(runner.model, runner.kv_caches, num_kv_groups=1,
                                     block_size=16, max_model_len=128, batch_sizes=[1, 2, 4],
                                     device=torch.device("cpu"))
            with torch.inference_mode():
                static.outputs = {b: static._forward(b) for b in static.batch_sizes}
            static.graphs = {b: EagerReplay(static, b) for b in static.batch_sizes}
            runner.cuda_graphs = static
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0,
                                                          ignore_eos=True))
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
        tokens[graphs] = [outs[f"r{i}"] for i in range(len(prompts))]
    assert EagerReplay.replays >= 9  # every decode step after the prefill went through it
    assert tokens[True] == tokens[False]


# ------------------------------------------------------------------ on a CUDA device
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def qwen3_shape(tmp_path_factory) -> str:
    """Qwen3-0.6B's config with random weights (``load_format="dummy"``)."""
    from tiny_models import make_shaped_checkpoint

    return str(make_shaped_checkpoint(tmp_path_factory.mktemp("shape"), "Qwen3-0.6B"))


@pytest.mark.cuda
@needs_cuda
def test_cuda_profile_captures_graphs_and_measures_them(qwen3_shape):
    shape = dict(model=qwen3_shape, load_format="dummy", device="cuda", max_num_seqs=64,
                 max_model_len=4096)
    p = profile_memory(EngineConfig(**shape))
    assert p.cuda_graph_sizes == capture_sizes(64)
    for value in (p.weights_bytes, p.forward_peak_bytes, p.sampler_peak_bytes,
                  p.cuda_graph_bytes, p.total_bytes):
        assert value > 0
    assert p.suggested_kv_bytes_fit == (p.requested_bytes - p.non_kv_bytes - p.headroom_bytes)
    eager = profile_memory(EngineConfig(**shape, enforce_eager=True))
    assert eager.cuda_graph_bytes == 0 and eager.cuda_graph_sizes == []


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_graph_decode_matches_eager(family, tmp_path):
    """fp32 greedy tokens through captured decode graphs and eagerly (qwen2: a sliding
    window layer beside a full one, two KV groups)."""
    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    model = str(make_tiny_checkpoint(tmp_path, family))
    prompts = [[256, 72, 101, 108, 108, 111], list(range(100, 140)), [256, 5, 9]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(model, device="cuda", dtype="float32", kv_cache_memory_bytes=64 * MiB,
                  enforce_eager=eager, max_model_len=256)
        assert (llm.engine.model_runner.cuda_graphs is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


@pytest.mark.cuda
@needs_cuda
def test_cuda_serving_at_095_survives_a_burst_of_max_length_requests(qwen3_shape):
    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    max_model_len = 2048
    free, total = torch.cuda.mem_get_info()  # creates this process's CUDA context
    before = total - free  # the context and other processes: outside the engine's share
    llm = LLM(qwen3_shape, load_format="dummy", device="cuda", gpu_memory_utilization=0.95,
              max_model_len=max_model_len, max_num_seqs=128)
    profile = llm.engine.memory_profile
    assert profile is not None and profile.cuda_graph_bytes > 0
    tail = list(range(1000, 1000 + max_model_len - 65))
    prompts = [[100 + i, *tail] for i in range(256)]  # no shared prefix: every block is new
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 64 and o.error is None for o in outputs)
    free, total = torch.cuda.mem_get_info()
    assert torch.cuda.max_memory_reserved() <= 0.95 * total
    # the device's view: the engine's non-torch memory included, what was there before not
    assert total - free <= 0.95 * total + before
