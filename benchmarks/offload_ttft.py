"""Time to first token of a repeated prompt: from the engine's own prefix cache, from the
CPU tier, from disk, and recomputed, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/offload_ttft.py [--tokens 2048] [--repeats 3]
    .venv/bin/python benchmarks/offload_ttft.py --model DIR --load-format dummy \\
        --device cuda --dtype bfloat16 --tokens 8192     # a real model's shape on a GPU

The model is the embedded SmolLM2-135M unless ``--model`` names a directory (with
``--load-format dummy``: config.json and tokenizer.json are enough). Each case runs the
prompt once to fill the cache and the tier, times a fresh request for it while the pool
still holds it (a prefix-cache hit), evicts it from the device pool with two different
prompts of the same length, then times a fresh request for the first prompt. "Recomputed"
runs the same sequence with offloading off. Offloading is turned on the way a user does
(``--cpu-offload-gib`` / ``--disk-offload-dir`` / ``--disk-offload-gib``, i.e.
``EngineConfig``); the pool holds one prompt and no more, so that the other prompts
evict all of it (a pool with room to spare keeps the first prompt's leading blocks,
since freed blocks are evicted last block first, and "recomputed" would be a partial
prefix hit; its cached tokens are printed). Each tier's budget holds all three prompts
(``tier_gib``): a smaller one evicts the first prompt's blocks, oldest first, while the
other two are stored, and the timed request finds nothing there. Stores are finished
before anything is timed, and each engine first runs a short prompt through the same
steps (prefill, prefix hit, a load from its tier), so that first-use costs (kernel
compilation, allocator growth) stay out of the figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

from kvmem.engine.config import EngineConfig
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams
from kvmem.units import GiB

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_shape(model: str | None, load_format: str, dtype: str, device: str
                ) -> tuple[int, int]:
    """KV bytes one token takes on one device for ``model`` (the planner's rule), and
    its vocabulary size."""
    from kvmem.engine.loader import resolve_model
    from kvmem.engine.rank_builder import resolve_device, resolve_dtype
    from kvmem.spec import spec_from_config

    files = resolve_model(model, load_format=load_format)
    spec = spec_from_config(files.config, files.name)
    torch_dtype = resolve_dtype(dtype, resolve_device(device))
    size = DTYPE_BYTES[str(torch_dtype).removeprefix("torch.")]
    return (sum(layer.bytes_per_token(1, size) for layer in spec.layers),
            int(files.config["vocab_size"]))


def tier_gib(tokens: int, per_token: int) -> float:
    """A tier budget holding the three prompts of a case, with a quarter to spare (a disk
    block's file header, rounding to whole blocks)."""
    return 3 * (tokens + 16) * per_token * 1.25 / GiB


def warm_up(engine: LLMEngine, vocab: int) -> None:
    """A short prompt through the steps a case times: a prefill, a prefix hit and, with
    a tier, a load from it (the pool's prefix cache dropped in between)."""
    prompt = [(7 * i) % (vocab - 1) + 1 for i in range(2 * 16 + 1)]
    ttft(engine, "warm-fill", prompt)
    ttft(engine, "warm-hit", prompt)
    if engine.offload:
        engine.offload.offload.drain()
        if not engine.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("warm-up: the prefix cache could not be reset")
        ttft(engine, "warm-load", prompt)
    engine.kv_cache_manager.reset_prefix_cache()


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


def run_case(name: str, tokens: int, repeats: int, engine_options: dict[str, Any] | None = None,
             **offload) -> dict[str, Any]:
    """``engine_options``: EngineConfig fields (model, device, dtype, load_format...)."""
    options = dict(engine_options or {})
    per_token, vocab = model_shape(options.get("model"), options.get("load_format", "auto"),
                                   options.get("dtype", "auto"), options.get("device", "auto"))
    rng = random.Random(0)
    top = min(40000, vocab)
    prompt = [rng.randrange(top // 4, top) for _ in range(tokens)]
    evictors = [[rng.randrange(top // 4, top) for _ in range(tokens)] for _ in range(2)]
    # the null block and one request of max_model_len: two other prompts evict all of it
    # (one leaves the first prompt's leading block, as freed blocks go last block first)
    max_model_len = tokens + 16
    blocks = 1 + (max_model_len + 15) // 16
    engine = LLMEngine(EngineConfig(max_model_len=max_model_len, max_num_batched_tokens=tokens,
                                    kv_cache_memory_bytes=blocks * 16 * per_token,
                                    **options, **offload))
    connector = engine.offload
    times, hits, hit_cached, outputs, cached = [], [], [], [], []
    try:
        warm_up(engine, top)
        for i in range(repeats):
            ttft(engine, f"fill{i}", prompt)
            if connector:
                connector.offload.drain()
            hit_s, _, hit_tokens = ttft(engine, f"hit{i}", prompt)
            hits.append(hit_s)
            hit_cached.append(hit_tokens)
            for j, evictor in enumerate(evictors):
                ttft(engine, f"evict{i}.{j}", evictor)
                if connector:
                    connector.offload.drain()
            t, out, hit = ttft(engine, f"timed{i}", prompt)
            times.append(t)
            outputs.append(out)
            cached.append(hit)
    finally:
        engine.shutdown()
    return {"case": name, "median_s": statistics.median(times), "runs": times,
            "prefix_hit_s": statistics.median(hits), "prefix_hit_cached_tokens": hit_cached,
            "cached_tokens": cached,
            "first_token": outputs[0]}


def run_cases(tokens: int, repeats: int, disk_dir: str,
              engine_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Recomputed, CPU tier and disk tier, in that order."""
    options = dict(engine_options or {})
    per_token, _ = model_shape(options.get("model"), options.get("load_format", "auto"),
                               options.get("dtype", "auto"), options.get("device", "auto"))
    gib = tier_gib(tokens, per_token)
    return [
        run_case("recomputed", tokens, repeats, engine_options),
        run_case("CPU tier", tokens, repeats, engine_options, cpu_offload_gib=gib),
        run_case("disk tier", tokens, repeats, engine_options, disk_offload_dir=disk_dir,
                 disk_offload_gib=gib),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    options = {"model": args.model, "load_format": args.load_format, "device": args.device,
               "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as disk_dir:
        results = run_cases(args.tokens, args.repeats, disk_dir, options)
    base = results[0]["median_s"]
    print(f"TTFT of a repeated {args.tokens}-token prompt, median of {args.repeats}")
    print(f"  {'prefix hit':<11} {results[1]['prefix_hit_s'] * 1000:8.1f} ms  "
          f"{base / results[1]['prefix_hit_s']:5.1f}x vs recomputed")
    for r in results:
        print(f"  {r['case']:<11} {r['median_s'] * 1000:8.1f} ms  {base / r['median_s']:5.1f}x "
              f"vs recomputed  cached tokens {r['cached_tokens']}  first token "
              f"{r['first_token']}")
    assert all(r["first_token"] == results[0]["first_token"] for r in results), \
        "offloaded runs produced a different first token"


if __name__ == "__main__":
    main()
