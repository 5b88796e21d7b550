"""How fast `kvmem plan` answers: process start-up against bare Python, and plan() itself.

    .venv/bin/python benchmarks/plan_speed.py [--runs 10]

Comparison runs in the same script: `python -c pass` (the floor any Python command pays)
and `python -c "import torch"` (what the planner avoids by never importing torch).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(runs: int) -> dict[str, float]:
    from kvmem.plan import EngineSettings, Layout, plan
    from kvmem.spec import load_spec

    cases = {
        "Qwen3-32B pp2 56,8 uniform": (load_spec("Qwen/Qwen3-32B"),
                                       Layout(pipeline_parallel_size=2, layer_partition=[56, 8]),
                                       EngineSettings(kv_cache_memory_bytes=5 << 30,
                                                      kv_cache_dtype="fp8"), "uniform"),
        "Llama-3.1-405B tp8 pp4 mixed H100/H200 optimal": (
            load_spec("meta-llama/Llama-3.1-405B"),
            Layout(tensor_parallel_size=8, pipeline_parallel_size=4,
                   gpus=["H100"] * 16 + ["H200"] * 16),
            EngineSettings(max_model_len=32768), "optimal"),
    }
    out = {}
    for name, (spec, layout, settings, policy) in cases.items():
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            plan(spec, layout, settings, policy=policy)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    py = sys.executable
    plan_cmd = [py, "-m", "kvmem", "plan", "Qwen/Qwen3-32B", "--pp", "2", "--layer-partition",
                "56,8", "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "5GiB"]
    floor = wall([py, "-c", "pass"], args.runs)
    rows = [
        ("python -c pass", floor),
        ("kvmem plan (table)", wall(plan_cmd, args.runs)),
        ("kvmem plan --json", wall(plan_cmd + ["--json"], args.runs)),
        ("python -c 'import torch'", wall([py, "-c", "import torch"], args.runs)),
    ]
    print(f"median of {args.runs} runs")
    for name, t in rows:
        print(f"  {name:28s} {t * 1000:8.0f} ms   {t / floor:5.1f}x python -c pass")
    for name, t in in_process(args.runs).items():
        print(f"  plan(): {name:46s} {t * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
