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
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.gpu.report import Report  # noqa: E402

HF_OUTPUT_TOKENS = 256
ANCHORS = "nano-vllm 1,434 tok/s and vLLM 1,362 tok/s on an RTX 4070 laptop GPU (their README)"


def workload(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024
             ) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py requests: (prompts, output lengths), in its order of draws."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_seqs)]
    outputs = [random.randint(100, max_output) for _ in range(num_seqs)]
    return prompts, outputs


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes moved (read + written) per second by a 1 GiB device-to-device copy."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - start)


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
    sync(device)
    start = time.perf_counter()
    while engine.has_work():
        running = engine.scheduler.running
        decode_only = len(running) == num_seqs and not engine.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in running)
        live = sum(r.num_computed_tokens + 1 for r in running) if decode_only else 0
        t0 = time.perf_counter()
        engine.step()
        if decode_only:
            full_steps.append((time.perf_counter() - t0, live))
    seconds = time.perf_counter() - start
    model_bytes = weight_bytes(engine.model_runner.model)
    return {"tokens": sum(outputs), "seconds": seconds, "tok_per_s": sum(outputs) / seconds,
            "graphs": engine.model_runner.cuda_graphs is not None,
            "full_decode_steps": full_steps, "weights_bytes": model_bytes,
            "kv_bytes_per_token": kv_per_token,
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
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                    min_new_tokens=longest, do_sample=True, temperature=0.6, top_k=0,
                    pad_token_id=0)
    sync(device)
    seconds = time.perf_counter() - start
    return {"requests": num_seqs, "tokens": sum(outputs), "padded_tokens": longest * num_seqs,
            "seconds": seconds, "tok_per_s": sum(outputs) / seconds}


def one(args: argparse.Namespace) -> None:
    if args.one == "transformers":
        result = run_transformers(args.model, args.device, args.hf_requests)
    else:
        result = run_kvmem(args.model, args.device, args.one == "eager", args.requests)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(args: argparse.Namespace, which: str, timeout: float) -> dict:
    argv = [sys.executable, __file__, "--one", which, "--model", args.model, "--device",
            args.device, "--out", str(args.out), "--requests", str(args.requests),
            "--hf-requests", str(args.hf_requests)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{which} run failed (rc {done.returncode}): "
                           f"{done.stderr.strip()[-1500:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="config-only directory (default: Qwen3-0.6B)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--hf-requests", type=int, default=64,
                   help=f"transformers: this many prompts, {HF_OUTPUT_TOKENS} tokens each")
    p.add_argument("--one", choices=("graphs", "eager", "transformers"))
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per engine run")
    args = p.parse_args()
    if args.model is None:
        from tiny_models import make_shaped_checkpoint

        args.model = str(make_shaped_checkpoint(Path(tempfile.mkdtemp()), "Qwen3-0.6B"))
    if args.one:
        one(args)
        return 0
    report = Report("engine_speed", args.out, args.device)
    report.line(f"Workload: nano-vllm's benchmark ({args.requests} requests, seed 0, "
                f"inputs and outputs of 100-1024 tokens), Qwen3-0.6B shape, random bf16 "
                f"weights. Anchors: {ANCHORS}.")
    results = {}
    for which in ("graphs", "eager", "transformers"):
        with report.check(f"{which} run"):
            results[which] = r = spawn(args, which, args.timeout)
            report.figure(f"{which} output tok/s", round(r["tok_per_s"], 1))
            report.figure(f"{which} seconds", round(r["seconds"], 2))
    if "graphs" in results and "eager" in results:
        report.figure("graphs / eager", round(results["graphs"]["tok_per_s"]
                                              / results["eager"]["tok_per_s"], 2))
    if "graphs" in results and "transformers" in results:
        report.figure("kvmem graphs / transformers generate",
                      round(results["graphs"]["tok_per_s"]
                            / results["transformers"]["tok_per_s"], 2))
    with report.check("decode step at full batch against the physical floor"):
        r = results["graphs"]
        steps = r["full_decode_steps"]
        assert steps, "no decode step ran all requests at once"
        bandwidth = copy_bandwidth(args.device)
        per_token = r["kv_bytes_per_token"]
        assert per_token, "the plan gave no KV bytes per token"
        step_s = sorted(s for s, _ in steps)[len(steps) // 2]
        live = sorted(t for _, t in steps)[len(steps) // 2]
        floor = (r["weights_bytes"] + live * per_token) / bandwidth
        report.figure("device-to-device copy GB/s (read + written)", round(bandwidth / 1e9, 1))
        report.figure("full-batch decode steps timed", len(steps))
        report.figure("median full-batch decode step ms", round(step_s * 1e3, 3))
        report.figure("median live KV tokens at those steps", live)
        report.figure("floor ms (weights + live KV read once)", round(floor * 1e3, 3))
        report.figure("decode step / floor", round(step_s / floor, 2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
