"""Measured memory profiles against the planner's estimates.

Runs ``kvmem profile --json`` in a fresh process for each setting (so that every run's
resident baseline is a clean start) and prints, next to each measured figure, what
``kvmem plan`` estimates for the same model and settings, and their ratio. Then the same
comparison for the three public vLLM profiles in shared/reference/vllm_profiles.md.

    .venv/bin/python benchmarks/memory_profile.py [--tokens 256,512,1024,2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kvmem.plan import estimates  # noqa: E402
from kvmem.spec import load_spec  # noqa: E402
from kvmem.units import GiB, MiB  # noqa: E402

# (model, GPU total GiB, tp, layers on the rank, max_num_batched_tokens, logged GiB:
#  weights, activation, non-torch, CUDA graphs or None)
PUBLIC = [
    ("google/gemma-3-4b-it", 178.36, 1, 34, 8192, 8.58, 9.96, 0.07, 0.65),
    ("meta-llama/Meta-Llama-3-8B", 39.50, 1, 32, 8192, 14.96, 9.37, 0.10, None),
    ("qwen/qwen3-235b-a22b", 44.42, 4, 94, 2048, 27.72, 1.4, 0.21, 3.45),
]


def measure(model: str, tokens: int, max_num_seqs: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "kvmem", "profile", model, "--device", "cpu", "--json",
            "--max-num-batched-tokens", str(tokens), "--max-model-len", str(tokens),
            "--max-num-seqs", str(max_num_seqs)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(out.stdout)


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def local(models: list[tuple[str, str]], token_counts: list[int], max_num_seqs: int) -> None:
    print("| model | tokens | forward peak MiB | sampler peak MiB | estimate MiB (fp32) | "
          "estimate / measured | non-torch MiB (est. 153.6) |")
    print("|---|---|---|---|---|---|---|")
    for label, model in models:
        spec = load_spec(model)
        spec32 = dataclasses.replace(spec, dtype="float32")  # the CPU engine runs fp32
        for tokens in token_counts:
            p = measure(model, tokens, max_num_seqs)
            activation = p["derived"]["activation_bytes"]
            estimate = estimates.activation_bytes(spec32, 1, tokens, True)
            print(f"| {label} | {tokens:,} | {mib(p['forward_peak_bytes'])} | "
                  f"{mib(p['sampler_peak_bytes'])} | {mib(estimate)} | "
                  f"{estimate / activation:.2f}x | {mib(p['non_torch_bytes'])} |", flush=True)


def public() -> None:
    print("\n| model | tp | activation logged / estimate GiB | error | CUDA graphs logged / "
          "estimate GiB | error | non-torch logged / estimate GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, _total, tp, layers, tokens, _w, act, non_torch, graphs in PUBLIC:
        spec = load_spec(name)
        est_act = estimates.activation_bytes(spec, tp, tokens, True) / GiB
        est_graphs = estimates.cuda_graph_bytes(layers, tp, 256) / GiB
        est_nt = estimates.non_torch_bytes(tp, 1) / GiB
        graph_cols = (f"{graphs:.2f} / {est_graphs:.2f} | {est_graphs / graphs - 1:+.0%}"
                      if graphs is not None else f"- / {est_graphs:.2f} | -")
        print(f"| {name} | {tp} | {act:.2f} / {est_act:.2f} | {est_act / act - 1:+.0%} | "
              f"{graph_cols} | {non_torch:.2f} / {est_nt:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,512,1024,2048",
                        help="max_num_batched_tokens values to profile")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    from tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(make_tiny_checkpoint(Path(tmp), "llama", hidden_size=256,
                                        intermediate_size=1024, num_hidden_layers=4,
                                        max_position_embeddings=4096))
        from kvmem.engine.loader import resolve_model

        embedded = str(resolve_model(None).path)
        local([("SmolLM2-135M (embedded)", embedded), ("tiny llama h256 x4", tiny)],
              token_counts, args.max_num_seqs)
    public()


if __name__ == "__main__":
    main()
