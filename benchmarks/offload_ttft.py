"""Time to first token of a repeated 2,048-token prompt: from the CPU tier, from disk, and
recomputed, on the embedded model, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/offload_ttft.py [--tokens 2048] [--repeats 3]

Each case runs the prompt once to fill the tier, evicts it from the device pool with a
different prompt of the same length, then times a fresh request for the first prompt.
"Recomputed" runs the same sequence with offloading off. Offloading is turned on the way
a user does (``--cpu-offload-gib`` / ``--disk-offload-dir`` / ``--disk-offload-gib``,
i.e. ``EngineConfig``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from kvmem.engine.config import EngineConfig
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in fp32


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, list[int], int]:
    start = time.perf_counter()
    request = engine.add_request(request_id, prompt, SamplingParams(max_tokens=1,
                                                                     temperature=0.0,
                                                                     ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            tokens = out.outputs[0].token_ids
    return first, tokens, request.num_cached_tokens


def run_case(name: str, tokens: int, repeats: int, **offload):
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
    evictor = [rng.randrange(100, 40000) for _ in range(tokens)]
    blocks = tokens // 16 + 8  # one prompt fits; a second one evicts the first
    engine = LLMEngine(EngineConfig(max_model_len=tokens + 64, max_num_batched_tokens=tokens,
                                    kv_cache_memory_bytes=blocks * 16 * BYTES_PER_TOKEN,
                                    **offload))
    connector = engine.offload
    times, outputs, cached = [], [], []
    try:
        for i in range(repeats):
            ttft(engine, f"fill{i}", prompt)
            if connector:
                connector.offload.drain()
            ttft(engine, f"evict{i}", evictor)
            if connector:
                connector.offload.drain()
            t, out, hit = ttft(engine, f"timed{i}", prompt)
            times.append(t)
            outputs.append(out)
            cached.append(hit)
    finally:
        engine.shutdown()
    return {"case": name, "median_s": statistics.median(times), "runs": times,
            "cached_tokens": cached, "first_token": outputs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as disk_dir:
        results = [
            run_case("recomputed", args.tokens, args.repeats),
            run_case("CPU tier", args.tokens, args.repeats, cpu_offload_gib=1),
            run_case("disk tier", args.tokens, args.repeats, disk_offload_dir=disk_dir,
                     disk_offload_gib=1),
        ]
    base = results[0]["median_s"]
    print(f"TTFT of a repeated {args.tokens}-token prompt, median of {args.repeats}")
    for r in results:
        print(f"  {r['case']:<11} {r['median_s'] * 1000:8.1f} ms  {base / r['median_s']:5.1f}x "
              f"vs recomputed  cached tokens {r['cached_tokens']}  first token "
              f"{r['first_token']}")
    assert all(r["first_token"] == results[0]["first_token"] for r in results), \
        "offloaded runs produced a different first token"


if __name__ == "__main__":
    main()
