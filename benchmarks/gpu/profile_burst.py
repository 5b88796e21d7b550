"""MISSION problem 5 on a GPU: profile gemma-3-4b-it's shape (random bf16 weights), then
serve a burst at gpu_memory_utilization 0.95 and at the profile's suggested explicit bytes.

    python benchmarks/gpu/profile_burst.py --device cuda --out DIR

Step 1 runs ``kvmem profile`` (weights, peak activation, non-torch and CUDA-graph memory,
the two suggested budgets) and, around the capture of the decode graphs, also reads
``torch.cuda.memory_stats`` (the caching allocator's view) to set beside the profile's
CUDA-graph figure (the driver's view: free memory before and after capture). Steps 2 and
3 each start an engine in a process of its own and send 256 distinct prompts at once;
both must finish every request with no out-of-memory error, inside the device's memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.gpu.report import Report  # noqa: E402

# google/gemma-3-4b-it's config.json, text part spelled out (the published file leaves
# most of it to Gemma3TextConfig's defaults, which are these values)
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "torch_dtype": "bfloat16", "eos_token_id": [1, 106], "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": 262208,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 1024, "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                      "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14},
}
BURST = 256
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 32
GiB = 1 << 30


def gemma_dir(root: Path) -> Path:
    from tiny_models import CHATML, byte_level_tokenizer_json

    out = root / "gemma-3-4b-it-config-only"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(GEMMA_3_4B_IT))
    (out / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return out


def profile(model: str, device: str, utilization: float) -> dict:
    """``kvmem profile --json``, with the allocator's statistics around graph capture."""
    import contextlib
    import io

    import torch

    from kvmem.cli import main as kvmem_main
    from kvmem.engine import cuda_graphs

    stats: dict[str, dict] = {}
    capture = cuda_graphs.CUDAGraphRunner.capture

    def measured_capture(self) -> None:
        torch.cuda.synchronize()
        stats["before"] = torch.cuda.memory_stats(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        capture(self)
        torch.cuda.synchronize()
        stats["after"] = torch.cuda.memory_stats(self.device)
        stats["driver_growth"] = free_before - torch.cuda.mem_get_info(self.device)[0]

    cuda_graphs.CUDAGraphRunner.capture = measured_capture
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = kvmem_main(["profile", model, "--load-format", "dummy", "--device", device,
                         "--dtype", "bfloat16", "--gpu-memory-utilization", str(utilization),
                         "--json"])
    if rc not in (0, None):
        raise RuntimeError(f"kvmem profile exited {rc}: {out.getvalue()[-2000:]}")
    result = json.loads(out.getvalue())
    result.update(result.pop("derived", {}))
    keys = ("reserved_bytes.all.current", "allocated_bytes.all.current",
            "reserved_bytes.all.peak", "allocated_bytes.all.peak")
    result["allocator_around_capture"] = {
        when: {k: stats[when].get(k) for k in keys} for when in ("before", "after")
    } if stats else None
    result["driver_growth_around_capture"] = stats.get("driver_growth")
    return result


def burst(model: str, device: str, **sizing) -> dict:
    import torch

    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    free, total = torch.cuda.mem_get_info()  # creates the CUDA context
    before = total - free  # the context and other processes: outside the engine's share
    llm = LLM(model, load_format="dummy", device=device, dtype="bfloat16", **sizing)
    prompts = [[3 + i, *range(1000, 1000 + PROMPT_TOKENS - 1)] for i in range(BURST)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, params, show_progress=False)
    failed = [o.error for o in outputs if o.error is not None
              or len(o.outputs[0].token_ids) != OUTPUT_TOKENS]
    free, total = torch.cuda.mem_get_info()
    return {"requests": len(outputs), "failed": failed[:3], "num_failed": len(failed),
            "kv_blocks": llm.engine.num_blocks,
            "max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "device_used_bytes": total - free, "device_total_bytes": total,
            "used_before_bytes": before}


def one(args: argparse.Namespace) -> None:
    if args.one == "profile":
        result = profile(args.model, args.device, 0.95)
    elif args.one == "burst-095":
        result = burst(args.model, args.device, gpu_memory_utilization=0.95)
    else:
        result = burst(args.model, args.device, kv_cache_memory_bytes=int(args.one))
    print("RESULT " + json.dumps(result), flush=True)


def spawn(args: argparse.Namespace, which: str) -> dict:
    argv = [sys.executable, __file__, "--one", which, "--model", args.model, "--device",
            args.device, "--out", str(args.out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{which} failed (rc {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-1500:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="config-only directory (default: gemma-3-4b-it)")
    p.add_argument("--one")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
    args = p.parse_args()
    if args.model is None:
        args.model = str(gemma_dir(Path(tempfile.mkdtemp())))
    if args.one:
        one(args)
        return 0
    report = Report("profile_burst", args.out, args.device)
    report.line(f"Model: {Path(args.model).name} (random bf16 weights). Burst: {BURST} "
                f"distinct prompts of {PROMPT_TOKENS} tokens, {OUTPUT_TOKENS} output tokens.")
    prof = None
    with report.check("kvmem profile"):
        prof = spawn(args, "profile")
        for key in ("weights_bytes", "forward_peak_bytes", "sampler_peak_bytes",
                    "non_torch_bytes", "cuda_graph_bytes", "suggested_kv_bytes_fit",
                    "suggested_kv_bytes_whole"):
            if key in prof:
                report.figure(f"profile {key} GiB", round(prof[key] / GiB, 3))
        report.figure("profile cuda_graph_sizes", len(prof.get("cuda_graph_sizes", [])))
        around = prof["allocator_around_capture"]
        if around:
            for k in ("reserved_bytes.all.current", "allocated_bytes.all.current"):
                delta = (around["after"][k] or 0) - (around["before"][k] or 0)
                report.figure(f"allocator {k} change over capture GiB", round(delta / GiB, 3))
            report.figure("driver free-memory drop over capture GiB",
                          round(prof["driver_growth_around_capture"] / GiB, 3))
        if args.device.startswith("cuda"):
            assert prof["cuda_graph_bytes"] > 0, "no CUDA-graph memory measured"
    for which in ("burst-095", str(prof["suggested_kv_bytes_fit"]) if prof else None):
        if which is None:
            continue
        title = ("burst at gpu_memory_utilization 0.95" if which == "burst-095"
                 else f"burst at the suggested explicit bytes ({int(which):,})")
        with report.check(title):
            r = spawn(args, which)
            report.figure(f"{title}: KV blocks", r["kv_blocks"])
            report.figure(f"{title}: device used GiB", round(r["device_used_bytes"] / GiB, 2))
            report.figure(f"{title}: max reserved GiB", round(r["max_reserved_bytes"] / GiB, 2))
            assert r["num_failed"] == 0, f"{r['num_failed']} requests failed: {r['failed']}"
            report.figure(f"{title}: in use before the engine (CUDA context) GiB",
                          round(r["used_before_bytes"] / GiB, 2))
            # gpu_memory_utilization is the engine's share, as in vLLM: the CUDA context
            # and other processes' memory at start are outside it
            assert r["max_reserved_bytes"] <= 0.95 * r["device_total_bytes"]
            assert (r["device_used_bytes"]
                    <= 0.95 * r["device_total_bytes"] + r["used_before_bytes"])
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
