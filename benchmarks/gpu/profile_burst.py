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
import sys
import tempfile
from pathlib import Path

import common

NAME = "profile_burst"

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


def gemma_dir(root: Path) -> str:
    return common.write_model(root, "gemma-3-4b-it", GEMMA_3_4B_IT)


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


def device_memory(device: str) -> tuple[int, int, int]:
    """(used, total, torch's peak reserved) bytes of ``device``; on CPU the machine's."""
    import torch

    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()  # the first call creates the CUDA context
        return total - free, total, torch.cuda.max_memory_reserved()
    import psutil

    memory = psutil.virtual_memory()
    return memory.total - memory.available, memory.total, 0


def burst(model: str, device: str, **sizing) -> dict:
    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    before = device_memory(device)[0]  # the context and other processes: not the engine's
    llm = LLM(model, load_format="dummy", device=device, dtype="bfloat16", **sizing)
    prompts = [[3 + i, *range(1000, 1000 + PROMPT_TOKENS - 1)] for i in range(BURST)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, params, show_progress=False)
    failed = [o.error for o in outputs if o.error is not None
              or len(o.outputs[0].token_ids) != OUTPUT_TOKENS]
    used, total, reserved = device_memory(device)
    return {"requests": len(outputs), "failed": failed[:3], "num_failed": len(failed),
            "kv_blocks": llm.engine.num_blocks, "max_reserved_bytes": reserved,
            "device_used_bytes": used, "device_total_bytes": total,
            "used_before_bytes": before}


def one(args: argparse.Namespace) -> None:
    if args.one == "profile":
        result = profile(args.model, args.device, 0.95)
    elif args.one == "burst-095":
        result = burst(args.model, args.device, gpu_memory_utilization=0.95)
    else:
        result = burst(args.model, args.device, kv_cache_memory_bytes=int(args.one))
    common.print_result(result)


def spawn(args: argparse.Namespace, which: str, report: common.Report) -> dict:
    argv = [sys.executable, __file__, "--one", which, "--model", args.model, "--device",
            args.device, "--out", str(args.out)]
    return common.run_child(argv, timeout=max(10.0, report.left_s()))


def profile_check(args, report: common.Report, found: dict) -> tuple[bool, str]:
    prof = found["profile"] = spawn(args, "profile", report)
    keys = ("weights_bytes", "forward_peak_bytes", "sampler_peak_bytes", "non_torch_bytes",
            "cuda_graph_bytes", "suggested_kv_bytes_fit", "suggested_kv_bytes_whole")
    report.figure("profile_GiB", {k: round(prof[k] / GiB, 3) for k in keys if k in prof})
    report.figure("cuda_graph_sizes", len(prof.get("cuda_graph_sizes", [])))
    around = prof["allocator_around_capture"]
    if around:
        report.figure("capture_GiB", {
            "driver_free_drop": round(prof["driver_growth_around_capture"] / GiB, 3),
            **{f"allocator_{k}": round(((around["after"][k] or 0)
                                        - (around["before"][k] or 0)) / GiB, 3)
               for k in ("reserved_bytes.all.current", "allocated_bytes.all.current")}})
    on_cuda = args.device.startswith("cuda")
    ok = prof["cuda_graph_bytes"] > 0 or not on_cuda
    return ok, (f"weights {prof['weights_bytes'] / GiB:.2f} GiB, CUDA graphs "
                f"{prof['cuda_graph_bytes'] / GiB:.3f} GiB, suggested KV "
                f"{prof['suggested_kv_bytes_fit'] / GiB:.2f} GiB (fit) / "
                f"{prof['suggested_kv_bytes_whole'] / GiB:.2f} GiB (whole)")


def burst_check(args, which: str, report: common.Report) -> tuple[bool, str]:
    r = spawn(args, which, report)
    report.figure(which, r)
    total = r["device_total_bytes"]
    # gpu_memory_utilization is the engine's share, as in vLLM: the CUDA context and other
    # processes' memory at start are outside it
    within = (r["max_reserved_bytes"] <= 0.95 * total
              and r["device_used_bytes"] <= 0.95 * total + r["used_before_bytes"])
    return r["num_failed"] == 0 and within, (
        f"{r['requests'] - r['num_failed']}/{r['requests']} requests finished "
        f"{r['failed'][:1]}; {r['kv_blocks']:,} KV blocks; torch's peak reserved "
        f"{r['max_reserved_bytes'] / GiB:.2f} GiB, device used "
        f"{r['device_used_bytes'] / GiB:.2f} GiB ({r['used_before_bytes'] / GiB:.2f} before "
        f"the engine) of {total / GiB:.2f}")


def main() -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None,
                       help="config-only directory (default: gemma-3-4b-it's shape)")
        p.add_argument("--one")

    args = common.parse_args(__doc__, 150.0, extra)
    if args.model is None:
        args.model = gemma_dir(Path(tempfile.mkdtemp(prefix="kvmem-profile-")))
    if args.one:
        one(args)
        return 0
    report = common.Report(NAME, "Memory profile and bursts at 0.95", args)
    report.notes.append(f"Model: {Path(args.model).name}'s shape, random bf16 weights. Burst: "
                        f"{BURST} distinct prompts of {PROMPT_TOKENS} tokens, {OUTPUT_TOKENS} "
                        "output tokens each.")
    found: dict = {}
    report.check("kvmem profile", lambda: profile_check(args, report, found))
    report.check("burst at gpu_memory_utilization 0.95",
                 lambda: burst_check(args, "burst-095", report), needs_s=30)
    if "profile" in found:
        fit = found["profile"]["suggested_kv_bytes_fit"]
        report.check(f"burst at the suggested explicit bytes ({fit:,})",
                     lambda: burst_check(args, str(fit), report), needs_s=30)
    return report.write()


if __name__ == "__main__":
    raise SystemExit(main())
