"""N engine instances of one model behind a router, replaying a shared-prefix workload:
each with a disk tier of its own ("alone"), then all on one disk directory ("shared").

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shared_prefix_tier.py [--instances 2 3 4]
        [--prefixes 3] [--prefix-tokens 1024] [--rounds 2]

The model is the embedded SmolLM2-135M (fp32) unless ``--model`` names a directory. Each
instance is a process with its own ``LLMEngine`` and a disk tier (no CPU tier), whose
device pool holds every prefix. The workload: ``--prefixes`` system prompts of
``--prefix-tokens`` tokens, each request one of them followed by 16 tokens of its own;
in round ``r``, step ``j`` (``P`` steps) sends each instance ``i`` in turn a request with
prefix ``(i + j + r) % P``, one request at a time, so every instance meets every prefix
and only one instance meets it first. A request's
stores are written before the next request is sent (what a busy deployment has had time
to do). Per mode: the prompt tokens skipped (the engine's own prefix cache and the disk
tier) over all prompt tokens, those loaded from disk, and the time to first token, of
all requests and of each instance's first request for a prefix, and the median TTFT of
first requests that computed the prefix and of those that loaded it from disk. Both
modes give every request the same first token (checked).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

SUFFIX_TOKENS = 16
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the instances import benchmarks.offload_ttft
    sys.path.insert(0, str(REPO))


def instance(conn: Any, disk_dir: str, options: dict[str, Any], max_model_len: int,
             pool_tokens: int) -> None:
    """One engine process: answers (request id, prompt) with (TTFT, first token, cached
    tokens, disk hit tokens) until it receives None."""
    import torch

    from benchmarks.offload_ttft import model_shape, ttft, warm_up
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.tiers import OffloadConfig

    torch.set_num_threads(1)
    per_token, vocab = model_shape(options.get("model"), "auto", "auto", "auto")
    engine = LLMEngine(EngineConfig(max_model_len=max_model_len,
                                    max_num_batched_tokens=max_model_len,
                                    kv_cache_memory_bytes=pool_tokens * per_token, **options),
                       offload=OffloadConfig(disk_dir=disk_dir, disk_bytes=1 << 30))
    warm_up(engine, min(40000, vocab))
    offload = engine.offload.offload
    conn.send("ready")
    while (message := conn.recv()) is not None:
        request_id, prompt = message
        before = offload.stats()["disk"].hit_tokens
        seconds, tokens, cached = ttft(engine, request_id, prompt)
        offload.drain()
        conn.send((seconds, tokens[0], cached, offload.stats()["disk"].hit_tokens - before))
    engine.shutdown()


def replay(n: int, shared: bool, prefixes: list[list[int]], rounds: int, root: Path,
           options: dict[str, Any]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    max_model_len = len(prefixes[0]) + SUFFIX_TOKENS + 16
    pool_tokens = (len(prefixes) + 2) * max_model_len
    pipes, procs = [], []
    for i in range(n):
        ours, theirs = ctx.Pipe()
        disk = root / ("shared" if shared else f"alone-{i}")
        procs.append(ctx.Process(target=instance, args=(theirs, str(disk), options,
                                                        max_model_len, pool_tokens)))
        procs[-1].start()
        pipes.append(ours)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    rng = random.Random(1)
    rows, seen = [], set()
    try:
        for r in range(rounds):
            for j in range(len(prefixes)):
                for i in range(n):
                    p = (i + j + r) % len(prefixes)
                    suffix = [rng.randrange(1000, 20000) for _ in range(SUFFIX_TOKENS)]
                    pipes[i].send((f"r{r}-{j}-{i}", prefixes[p] + suffix))
                    seconds, first, cached, from_disk = pipes[i].recv()
                    rows.append({"instance": i, "prefix": p, "first_sighting": (i, p) not in seen,
                                 "ttft": seconds, "token": first, "cached": cached,
                                 "disk": from_disk, "prompt": len(prefixes[p]) + SUFFIX_TOKENS})
                    seen.add((i, p))
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(120)
    prompt = sum(r["prompt"] for r in rows)
    firsts = [r for r in rows if r["first_sighting"]]
    computed = [r["ttft"] for r in firsts if r["cached"] == 0]
    loaded = [r["ttft"] for r in firsts if r["disk"] > 0]
    return {"instances": n, "mode": "shared" if shared else "alone", "rows": rows,
            "hit_rate": sum(r["cached"] for r in rows) / prompt,
            "disk_rate": sum(r["disk"] for r in rows) / prompt,
            "ttft_mean": statistics.mean(r["ttft"] for r in rows),
            "first_ttft_mean": statistics.mean(r["ttft"] for r in firsts),
            "computed_prefixes": len(computed),
            "computed_ttft": statistics.median(computed) if computed else None,
            "loaded_ttft": statistics.median(loaded) if loaded else None}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    args = parser.parse_args()
    if not all(2 <= n <= 8 for n in args.instances) or args.prefixes < 1 or \
            args.prefix_tokens < 16 or args.rounds < 1:
        parser.error("--instances 2..8, --prefixes >= 1, --prefix-tokens >= 16, --rounds >= 1")
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(args.prefix_tokens)]
                for _ in range(args.prefixes)]
    options = {"model": args.model}
    print(f"{args.prefixes} prefixes of {args.prefix_tokens} tokens (+{SUFFIX_TOKENS} of "
          f"each request's own), {args.rounds} rounds; every instance meets every prefix")
    print(f"{'N':>2} {'mode':<7} {'skipped':>8} {'from disk':>9} {'TTFT mean':>10} "
          f"{'1st sight':>10} {'computed':>8} {'computing':>10} {'loading':>9}")
    for n in args.instances:
        with tempfile.TemporaryDirectory() as tmp:
            results = [replay(n, shared, prefixes, args.rounds, Path(tmp), options)
                       for shared in (False, True)]
        alone, shared = results
        assert [r["token"] for r in alone["rows"]] == [r["token"] for r in shared["rows"]], \
            "a shared disk tier changed a first token"
        for r in results:
            print(f"{n:>2} {r['mode']:<7} {r['hit_rate']:>8.1%} {r['disk_rate']:>9.1%} "
                  f"{r['ttft_mean'] * 1000:>8.0f}ms {r['first_ttft_mean'] * 1000:>8.0f}ms "
                  f"{r['computed_prefixes']:>8} {ms(r['computed_ttft']):>10} "
                  f"{ms(r['loaded_ttft']):>9}")
        print(f"   shared vs alone: first-sighting TTFT "
              f"{alone['first_ttft_mean'] / shared['first_ttft_mean']:.1f}x lower, mean "
              f"{alone['ttft_mean'] / shared['ttft_mean']:.1f}x lower", flush=True)


if __name__ == "__main__":
    main()
