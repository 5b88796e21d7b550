"""Offline throughput on a GPU: kvmem's engine with and without CUDA graphs, beside
transformers ``generate``, on Qwen3-0.6B's shape with random bf16 weights.

    python benchmarks/gpu/engine_speed.py --device cuda --out DIR

The workload is nano-vllm's benchmark: 256 requests, ``random.seed(0)``, prompts of
randint(100, 1024) token ids drawn from randint(0, 10000), outputs of randint(100, 1024)
tokens (ignore_eos, temperature 0.6); output tok/s = requested output tokens / wall time.
Each engine runs in a process of its own (``--one``), so that each profiles the device
from a clean start. The decode steps that run all 256 requests are timed one by one and
set against the physical floor: the time to read the weights and the live KV once at the
rate a device-to-device copy reaches in the same run.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import common

NAME = "engine_speed"

HF_OUTPUT_TOKENS = 256
FIRST_RUN_TOK_S = 1980  # kvmem with CUDA graphs on an H100, before the decode kernel's change
PROFILED_STEP = 20  # the full-batch decode step (counting from 0) run under the profiler
ANCHORS = "nano-vllm 1,434 tok/s and vLLM 1,362 tok/s on an RTX 4070 laptop GPU (their README)"


def workload(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024
             ) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py requests: (prompts, output lengths), in its order of draws."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_seqs)]
    outputs = [random.randint(100, max_output) for _ in range(num_seqs)]
    return prompts, outputs


def copy_bandwidth(device: str) -> float:
    """Bytes moved (read + written) per second by a 1 GiB device-to-device copy."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    common.sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    common.sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - start)


def profile_step(engine, device: str, live_kv_bytes: int) -> dict:
    """One engine step under torch's profiler: its top kernels by device time, and the
    attention kernels' achieved rate over the live KV they read (each layer's K and V
    once). The step's wall time is returned so that throughput can leave it out."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.startswith("cuda") else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.step()
        common.sync(device)
    wall = time.perf_counter() - t0
    rows = []  # kernels by device time (on a CPU: operators by CPU time, a shake-out)
    for e in prof.key_averages():
        us = e.self_device_time_total if device.startswith("cuda") else e.self_cpu_time_total
        if us > 0 and e.key:
            rows.append((us, e.key, e.count))
    rows.sort(reverse=True)
    total_us = sum(us for us, _, _ in rows)
    attention_us = sum(us for us, name, _ in rows if "attention" in name or "decode" in name)
    return {"profiled_step_s": wall, "kernel_us_total": round(total_us, 1),
            "top": [{"kernel": name[:90], "us": round(us, 1), "calls": n,
                     "share": round(us / total_us, 3) if total_us else None}
                    for us, name, n in rows[:10]],
            "attention_us": round(attention_us, 1),
            "attention_GBps": round(live_kv_bytes / (attention_us * 1e-6) / 1e9, 1)
            if attention_us else None}


def decode_kernel_rates(device: str, num_seqs: int = 256, mean_len: int = 600,
                        tiles: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """The Triton decode kernels alone on Qwen3-0.6B's attention shape (16 query heads,
    8 KV heads of 128, bf16, 16-token blocks) at a full batch of contexts around
    ``mean_len`` tokens: GB/s of live K and V read, for each tile of blocks per loop step."""
    import random as rnd

    import torch

    from kvmem.engine.attention.metadata import AttentionMetadata
    from kvmem.engine.attention.triton_backend import TritonBackend

    rng = rnd.Random(0)
    lens = [rng.randint(mean_len // 2, 3 * mean_len // 2) for _ in range(num_seqs)]
    blocks = [-(-n // 16) for n in lens]
    ids = list(range(1, sum(blocks) + 1))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at:at + n])
        at += n
    cache = torch.randn(sum(blocks) + 1, 2, 16, 8, 128, device=device, dtype=torch.bfloat16)
    meta = AttentionMetadata.build([1] * num_seqs, lens, [tables], 16, device)
    q = torch.randn(num_seqs, 16, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(num_seqs, 8, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    live = sum(lens) * 2 * 8 * 128 * 2
    rates, outs = {}, {}
    for tile in tiles:
        backend = TritonBackend(tile)
        for _ in range(3):
            outs[tile] = backend.forward(q, k, v, cache, meta, 0, 0.088)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            backend.forward(q, k, v, cache, meta, 0, 0.088)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 20
        rates[tile] = {"us": round(seconds * 1e6, 1), "GBps": round(live / seconds / 1e9, 1)}
    worst = max(float((outs[t].float() - outs[tiles[0]].float()).abs().max()) for t in tiles)
    return {"live_kv_bytes": live, "seqs": num_seqs, "tokens": sum(lens), "by_tile": rates,
            "max_abs_diff_between_tiles": worst}


def kernel_check(args, report: common.Report) -> tuple[bool | None, str]:
    if not args.device.startswith("cuda"):
        return None, "the Triton kernels run on a GPU only (tests/test_attention.py checks " \
            "them in Triton's interpreter)"
    r = report.figure("decode_kernel", decode_kernel_rates(args.device))
    by = ", ".join(f"{t} blocks/step {x['GBps']:,.0f} GB/s ({x['us']:.0f} us)"
                   for t, x in r["by_tile"].items())
    return r["max_abs_diff_between_tiles"] < 2e-2, (
        f"{r['seqs']} contexts, {r['tokens']:,} tokens, {r['live_kv_bytes'] / 1e9:.2f} GB of "
        f"K/V: {by}; outputs agree within {r['max_abs_diff_between_tiles']:.1e}")


def run_kvmem(model: str, device: str, eager: bool, num_seqs: int) -> dict:
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.engine.models.layers import weight_bytes
    from kvmem.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device=device,
                                    dtype="bfloat16", enforce_eager=eager,
                                    max_model_len=2048, max_num_seqs=num_seqs))
    prompts, outputs = workload(num_seqs)
    warm = SamplingParams(max_tokens=16, temperature=0.6, ignore_eos=True)
    engine.add_request("warm", [1, 2, 3, 4], warm)
    while engine.has_work():
        engine.step()
    kv_per_token = engine.kv_plan.ranks[0].kv_bytes_per_token
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.6,
                                                      ignore_eos=True))
    full_steps: list[tuple[float, int]] = []  # (seconds, live KV tokens) at batch num_seqs
    kernels: dict = {}
    common.sync(device)
    start = time.perf_counter()
    while engine.has_work():
        running = engine.scheduler.running
        decode_only = len(running) == num_seqs and not engine.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in running)
        live = sum(r.num_computed_tokens + 1 for r in running) if decode_only else 0
        if decode_only and len(full_steps) == PROFILED_STEP:  # one step under the profiler
            kernels = profile_step(engine, device, live * kv_per_token)
            continue
        t0 = time.perf_counter()
        engine.step()
        if decode_only:
            full_steps.append((time.perf_counter() - t0, live))
    seconds = time.perf_counter() - start - kernels.get("profiled_step_s", 0.0)
    model_bytes = weight_bytes(engine.model_runner.model)
    return {"tokens": sum(outputs), "seconds": seconds, "tok_per_s": sum(outputs) / seconds,
            "graphs": engine.model_runner.cuda_graphs is not None,
            "full_decode_steps": full_steps, "weights_bytes": model_bytes,
            "kv_bytes_per_token": kv_per_token, "kernels": kernels,
            "memory_profile": engine.memory_profile and engine.memory_profile.to_dict()}


def run_transformers(model: str, device: str, num_seqs: int) -> dict:
    """``generate`` over the first ``num_seqs`` prompts in one left-padded batch, each to
    ``HF_OUTPUT_TOKENS`` tokens (the whole workload would take transformers minutes)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    hf = hf.to(torch.bfloat16).eval()
    prompts, outputs = workload()
    prompts = prompts[:num_seqs]
    outputs = [HF_OUTPUT_TOKENS] * num_seqs
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    longest = max(outputs)
    common.sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                    min_new_tokens=longest, do_sample=True, temperature=0.6, top_k=0,
                    pad_token_id=0)
    common.sync(device)
    seconds = time.perf_counter() - start
    return {"requests": num_seqs, "tokens": sum(outputs), "padded_tokens": longest * num_seqs,
            "seconds": seconds, "tok_per_s": sum(outputs) / seconds}


def one(args: argparse.Namespace) -> None:
    if args.one == "transformers":
        common.print_result(run_transformers(args.model, args.device, args.hf_requests))
    else:
        common.print_result(run_kvmem(args.model, args.device, args.one == "eager",
                                      args.requests))


def spawn(args: argparse.Namespace, which: str, report: common.Report) -> dict:
    argv = [sys.executable, __file__, "--one", which, "--model", args.model, "--device",
            args.device, "--out", str(args.out), "--requests", str(args.requests),
            "--hf-requests", str(args.hf_requests)]
    return common.run_child(argv, timeout=max(10.0, report.left_s()))


def run_check(args, which: str, report: common.Report, results: dict) -> tuple[bool, str]:
    r = results[which] = spawn(args, which, report)
    report.figure(which, {k: v for k, v in r.items() if k != "full_decode_steps"})
    goal = f" (goal {3 * FIRST_RUN_TOK_S:,} tok/s: 3x the first H100 run's)" \
        if which == "graphs" else ""
    return True, f"{r['tokens']:,} output tokens in {r['seconds']:.1f} s: " \
        f"{r['tok_per_s']:,.0f} tok/s{goal}"


def floor_check(args, results: dict, report: common.Report) -> tuple[bool | None, str]:
    """The median full-batch decode step against reading the weights and the live KV once
    at the rate a device-to-device copy reaches in this run."""
    if "graphs" not in results:
        return None, "the CUDA-graph run gave no steps to time"
    r = results["graphs"]
    steps = r["full_decode_steps"]
    if not steps:
        return False, "no decode step ran every request at once"
    bandwidth = copy_bandwidth(args.device)
    step_s = sorted(s for s, _ in steps)[len(steps) // 2]
    live = sorted(t for _, t in steps)[len(steps) // 2]
    floor = (r["weights_bytes"] + live * r["kv_bytes_per_token"]) / bandwidth
    kernels = r.get("kernels") or {}
    if not kernels.get("top") and results.get("eager", {}).get("kernels"):
        # the profiler may not see inside a graph's replay: the eager run's step launches
        # the same kernels one by one
        kernels = {**results["eager"]["kernels"], "from": "eager run"}
    report.figure("kernels", kernels)
    report.figure("floor", {"copy_GBps_read_plus_written": round(bandwidth / 1e9, 1),
                            "steps_timed": len(steps), "median_step_ms": round(step_s * 1e3, 2),
                            "median_live_kv_tokens": live, "floor_ms": round(floor * 1e3, 2),
                            "step_over_floor": round(step_s / floor, 2)})
    top = "; ".join(f"{k['kernel'][:40]} {k['us'] / 1e3:.2f} ms"
                    for k in kernels.get("top", [])[:4])
    return step_s / floor <= 2.5, (
        f"median of {len(steps)} steps {step_s * 1e3:.1f} ms with {live:,} live KV tokens; "
        f"floor {floor * 1e3:.2f} ms at {bandwidth / 1e9:.0f} GB/s: {step_s / floor:.1f}x "
        f"(goal 2.5x); attention kernels {kernels.get('attention_GBps')} GB/s of live KV; "
        f"top kernels of one step: {top}")


def main() -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None,
                       help="config-only directory (default: Qwen3-0.6B's shape)")
        p.add_argument("--requests", type=int, default=256)
        p.add_argument("--hf-requests", type=int, default=64,
                       help=f"transformers: this many prompts, {HF_OUTPUT_TOKENS} tokens each")
        p.add_argument("--one", choices=("graphs", "eager", "transformers"))

    args = common.parse_args(__doc__, 240.0, extra)
    if args.model is None:
        args.model = common.qwen3_0_6b(Path(tempfile.mkdtemp(prefix="kvmem-speed-")))
    if args.one:
        one(args)
        return 0
    report = common.Report(NAME, "Offline throughput (nano-vllm's workload)", args)
    report.notes.append(f"Workload: nano-vllm's benchmark ({args.requests} requests, seed 0, "
                        "inputs and outputs of 100-1024 tokens), random bf16 weights; "
                        f"transformers: {args.hf_requests} of the prompts, "
                        f"{HF_OUTPUT_TOKENS} tokens each. Anchors: {ANCHORS}.")
    results: dict = {}
    report.check("Triton decode kernels alone, by blocks per loop step",
                 lambda: kernel_check(args, report), needs_s=20)
    for which, needs in (("graphs", 80), ("eager", 80), ("transformers", 40)):
        report.check(f"kvmem {which}" if which != "transformers" else "transformers generate",
                     lambda w=which: run_check(args, w, report, results), needs_s=needs)
    if "graphs" in results and "eager" in results:
        report.figure("graphs_over_eager", round(results["graphs"]["tok_per_s"]
                                                 / results["eager"]["tok_per_s"], 2))
    if "graphs" in results and "transformers" in results:
        report.figure("graphs_over_transformers", round(
            results["graphs"]["tok_per_s"] / results["transformers"]["tok_per_s"], 2))
    report.check("full-batch decode step against the physical floor",
                 lambda: floor_check(args, results, report))
    return report.write()


if __name__ == "__main__":
    raise SystemExit(main())
