"""KV copies between the device and the CPU tier, and reload time to first token.

    python benchmarks/gpu/tier_copies.py --device cuda --out DIR [--quick]
    python benchmarks/gpu/tier_copies.py --device cpu --out DIR --quick   # CPU shake-out

1. Bandwidth: Qwen3-0.6B's KV layout (28 slots of ``[blocks, 2, 16, 8, 128]`` bf16,
   1.75 MiB a block) in a plain pool; the CPU tier (``kvmem.tiers.OffloadManager``)
   stores N blocks and loads them back into other blocks, timed end to end (offer ->
   drain, lookup -> load -> drain), against a plain ``copy_`` of the same bytes between
   one device tensor and one pinned host tensor, in the same run. The loaded blocks must
   equal the stored ones byte for byte.
2. Reload TTFT in kvmem's engine (``benchmarks/offload_ttft.py``'s method) for prompts of
   1k, 8k and 32k tokens, Qwen3-0.6B's shape with dummy bf16 weights: its own prefix
   cache, the CPU tier, the disk tier (a temporary folder), recomputed. Printed beside a
   public H20 measurement (GPU prefix hit 42 ms at 1k to 111 ms at 64k, CPU-tier hit 57
   to 272 ms, recompute 78 ms to 15.2 s; CPU reload about 54 GB/s).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402 - puts the repository on sys.path

NAME = "tier_copies"
GB = 1e9
ANCHOR = ("Anchor, a public H20 measurement: GPU prefix hit 42 ms at 1k to 111 ms at 64k "
          "tokens, CPU-tier hit 57 to 272 ms, recompute 78 ms to 15.2 s; CPU reload about "
          "54 GB/s.")


class Holder:
    """The pool's side of a store: blocks held while they are copied (none are reused
    here, so holding is only counted)."""

    def __init__(self) -> None:
        self.held = 0

    def hold(self, block_ids) -> None:
        self.held += len(block_ids)

    def release(self, block_ids) -> None:
        self.held -= len(block_ids)


def plain_copy_gbs(nbytes: int, device: str, repeats: int = 3) -> tuple[float, float]:
    """GB/s of one ``copy_`` device -> pinned host and back, best of ``repeats``."""
    import torch

    pinned = device.startswith("cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, (dst, src) in enumerate(((host, dev), (dev, host))):
            common.sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            common.sync(device)
            best[i] = min(best[i], time.perf_counter() - t)
    return nbytes / best[0] / GB, nbytes / best[1] / GB


def check_bandwidth(args, report: common.Report) -> tuple[bool, str]:
    import torch

    from kvmem.memory.storage import SlotShape, TensorKVStorage
    from kvmem.tiers.config import OffloadConfig
    from kvmem.tiers.manager import OffloadManager

    n = args.blocks
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    storage = TensorKVStorage(2 * n + 1, 28, SlotShape(2, 16, 8, 128), dtype, args.device)
    for s in range(28):
        storage.slot_tensor(s).normal_()
    gib = (n * 28 * 2 * 16 * 8 * 128 * storage.slot_tensor(0).element_size()) / (1 << 30)
    manager = OffloadManager(OffloadConfig.from_gib(gib * 1.1 + 0.01, None, 0, "lru"),
                             storage, 28, Holder(), model="dummy", layout="tier-copies")
    try:
        src, dst, keys = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1)), list(range(n))
        nbytes = n * manager.copier.block_nbytes
        common.sync(args.device)
        t = time.perf_counter()
        queued = manager.offer(src, keys)
        manager.drain()
        store_s = time.perf_counter() - t
        found = manager.lookup(keys)
        t = time.perf_counter()
        handle = manager.load("reload", keys, dst)
        loaded = manager.drain()
        load_s = time.perf_counter() - t
        equal = all(torch.equal(storage.slot_tensor(s)[1:n + 1], storage.slot_tensor(s)[n + 1:])
                    for s in range(28))
    finally:
        manager.shutdown()
    d2h, h2d = plain_copy_gbs(nbytes, args.device)
    figures = report.figure("bandwidth", {
        "blocks": n, "bytes": nbytes, "block_bytes": manager.copier.block_nbytes,
        "store_gbs": nbytes / store_s / GB, "load_gbs": nbytes / load_s / GB,
        "plain_d2h_gbs": d2h, "plain_h2d_gbs": h2d, "queued": queued, "found": found,
        "load_ok": [h.request_id for h in loaded] == [handle.request_id]})
    ok = queued == n and found == n and equal
    return ok, (f"{n} blocks ({nbytes / GB:.2f} GB): store {figures['store_gbs']:.1f} GB/s vs "
                f"plain copy_ to pinned {d2h:.1f} GB/s ({figures['store_gbs'] / d2h:.2f}x); "
                f"load {figures['load_gbs']:.1f} GB/s vs {h2d:.1f} GB/s "
                f"({figures['load_gbs'] / h2d:.2f}x); reloaded blocks equal: {equal}")


def decode_engine(args, model: str, cpu_gib: float, **options):
    """Qwen3-0.6B's shape (the tiny Llama with --quick) with CUDA graphs and a CPU tier."""
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine

    cuda = args.device.startswith("cuda")
    options.setdefault("enforce_eager", not cuda)
    return LLMEngine(EngineConfig(model=model, load_format="dummy", device=args.device,
                                  dtype="bfloat16" if cuda else "float32",
                                  cpu_offload_gib=cpu_gib, **options))


def timed_steps(engine, n: int, until=None) -> list[float]:
    """Seconds of each of ``n`` engine steps (``until()`` true: stop early)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        if until is not None and until():
            break
    return times


def check_overlap(args, model: str, report: common.Report) -> tuple[bool, str]:
    """Decode steps of a full batch alone, then while the CPU tier stores blocks and while
    it loads them back, on its side stream: the copies must overlap the steps (at most
    1.1x the step alone, medians)."""
    import statistics

    from kvmem.engine.sampling_params import SamplingParams

    batch, prompt_len = (8, 64) if args.quick else (128, 512)
    num_store = batch * prompt_len // 16  # every full block of the running requests
    block_bytes = 28 * 2 * 16 * 8 * 128 * 2 if not args.quick else 4 * 2 * 16 * 2 * 64 * 4
    engine = decode_engine(args, model, 1.2 * num_store * block_bytes / (1 << 30) + 0.01,
                           max_model_len=2048, max_num_seqs=batch)
    try:
        manager = engine.offload.offload
        pool = engine.kv_cache_manager.pool
        dst = pool.take_new_blocks(num_store // 2, 0)  # where the loads land: no request's
        params = SamplingParams(max_tokens=1500, temperature=0.6, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{i}", [(7 * i + j) % 251 + 1 for j in range(prompt_len)],
                               params)
        sched = engine.scheduler
        while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                   for r in sched.running):
            engine.step()
        timed_steps(engine, 10)  # warm
        alone = timed_steps(engine, 30)
        src = [b for r in sched.running for b in
               engine.kv_cache_manager.get_block_ids(r.request_id)[0][:prompt_len // 16]]
        keys = [(0, i.to_bytes(16, "little")) for i in range(len(src))]
        t0 = time.perf_counter()
        queued = manager.offer(src, keys)
        storing = timed_steps(engine, 400, until=lambda: manager.held_blocks == 0)
        store_s = time.perf_counter() - t0
        manager.drain()
        t0 = time.perf_counter()
        handle = manager.load("overlap-load", keys[:len(dst)], dst)
        loading = timed_steps(engine, 400, until=handle.done.is_set)
        load_s = time.perf_counter() - t0
        manager.drain()
        pool.free_blocks(dst)
    finally:
        engine.shutdown()
    med = {k: statistics.median(v) * 1e3 for k, v in
           (("alone", alone), ("storing", storing), ("loading", loading))}
    figures = report.figure("overlap", {
        "batch": batch, "step_ms": {k: round(v, 3) for k, v in med.items()},
        "steps": {"alone": len(alone), "storing": len(storing), "loading": len(loading)},
        "store_blocks": queued, "store_gbs": round(queued * block_bytes / store_s / GB, 2),
        "load_blocks": len(dst), "load_gbs": round(len(dst) * block_bytes / load_s / GB, 2),
        "store_over_alone": round(med["storing"] / med["alone"], 3),
        "load_over_alone": round(med["loading"] / med["alone"], 3)})
    ok = queued == len(src) and max(figures["store_over_alone"],
                                    figures["load_over_alone"]) <= 1.1
    return ok, (f"batch {batch}: step {med['alone']:.2f} ms alone, {med['storing']:.2f} ms "
                f"over {len(storing)} steps of a store of {queued} blocks "
                f"({figures['store_over_alone']:.2f}x, {figures['store_gbs']:.1f} GB/s), "
                f"{med['loading']:.2f} ms over {len(loading)} steps of a load of {len(dst)} "
                f"({figures['load_over_alone']:.2f}x, {figures['load_gbs']:.1f} GB/s)")


def check_break_even(args, model: str, report: common.Report) -> tuple[bool | None, str]:
    """Time to first token of a prompt loaded from the CPU tier against the same length
    recomputed, over short lengths, in one engine: the shortest length where the load wins
    is the break-even (``--offload-min-load-tokens``). Then an engine given that setting
    must recompute a shorter hit (counted as short hits) and load a longer one."""
    import statistics

    import offload_ttft

    lengths = (64, 128, 256) if args.quick else (128, 256, 512, 1024, 2048, 4096)
    engine = decode_engine(args, model, 2.0 if not args.quick else 0.05,
                           max_model_len=max(lengths) + 32, enforce_eager=True)
    rows = {}
    try:
        offload_ttft.warm_up(engine, 250)
        for n in lengths:
            load, recompute = [], []
            for rep in range(3):
                base = 1000 * (n + rep)
                prompt = [(base + 13 * j) % 240 + 5 for j in range(n)]
                fresh = [(base + 17 * j + 3) % 240 + 5 for j in range(n)]
                offload_ttft.ttft(engine, f"fill{n}.{rep}", prompt)
                engine.offload.offload.drain()
                if not engine.kv_cache_manager.reset_prefix_cache():
                    raise RuntimeError("the prefix cache could not be reset")
                t, _, cached = offload_ttft.ttft(engine, f"load{n}.{rep}", prompt)
                if cached == 0:
                    raise RuntimeError(f"{n} tokens: the CPU tier served none of the prompt")
                load.append(t)
                recompute.append(offload_ttft.ttft(engine, f"new{n}.{rep}", fresh)[0])
                engine.offload.offload.drain()
                engine.kv_cache_manager.reset_prefix_cache()
            rows[n] = (statistics.median(load) * 1e3, statistics.median(recompute) * 1e3)
    finally:
        engine.shutdown()
    wins = [n for n, (load, rec) in rows.items() if load < rec]
    # the break-even: the shortest length from which every longer one loads faster
    even = next((n for n in lengths if all(m in wins for m in lengths if m >= n)), None)
    report.figure("break_even", {"ms_load_vs_recompute": {n: [round(a, 2), round(b, 2)]
                                                          for n, (a, b) in rows.items()},
                                 "min_load_tokens": even})
    table = ", ".join(f"{n}: {a:.1f} vs {b:.1f} ms" for n, (a, b) in rows.items())
    if even is None:
        return None, f"no length up to {max(lengths)} loads faster ({table})"
    if even == lengths[0]:
        return True, f"every length loads faster: break-even at most {even} tokens ({table})"
    below = lengths[lengths.index(even) - 1]
    ok, why = short_hit_check(args, model, even, below)
    return ok, f"break-even {even} tokens (load vs recompute: {table}); {why}"


def short_hit_check(args, model: str, even: int, below: int) -> tuple[bool, str]:
    """An engine with ``--offload-min-load-tokens even``: a ``below``-token prompt in the
    CPU tier is recomputed (short hits), an ``even``-token one loaded."""
    import offload_ttft

    engine = decode_engine(args, model, 1.0 if not args.quick else 0.05,
                           max_model_len=even + 32, enforce_eager=True,
                           offload_min_load_tokens=even - 16)
    cached = {}
    try:
        for n in (below, even):
            prompt = [(29 * j + n) % 240 + 5 for j in range(n)]
            offload_ttft.ttft(engine, f"fill{n}", prompt)
            engine.offload.offload.drain()
            engine.kv_cache_manager.reset_prefix_cache()
            cached[n] = offload_ttft.ttft(engine, f"again{n}", prompt)[2]
        short = engine.offload.offload.stats()["cpu"].short_hits
    finally:
        engine.shutdown()
    ok = cached[below] == 0 and short > 0 and cached[even] > 0
    return ok, (f"with --offload-min-load-tokens {even - 16}: {below} tokens recomputed "
                f"({short} short-hit blocks), {even} tokens loaded ({cached[even]} cached)")


def check_ttft(tokens: int, args, model: str, report: common.Report) -> tuple[bool, str]:
    import offload_ttft

    options = {"model": model, "load_format": "dummy", "device": args.device,
               "dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
               "enforce_eager": True}
    with tempfile.TemporaryDirectory() as disk_dir:
        recomputed, cpu, disk = offload_ttft.run_cases(tokens, 1, disk_dir, options)
    ms = {"prefix cache": cpu["prefix_hit_s"] * 1000, "CPU tier": cpu["median_s"] * 1000,
          "disk tier": disk["median_s"] * 1000, "recomputed": recomputed["median_s"] * 1000}
    report.figure(f"ttft_{tokens}", {**{k: round(v, 2) for k, v in ms.items()},
                                     "cached_tokens": {"prefix cache":
                                                       cpu["prefix_hit_cached_tokens"],
                                                       "recomputed": recomputed["cached_tokens"],
                                                       "cpu": cpu["cached_tokens"],
                                                       "disk": disk["cached_tokens"]}})
    same = recomputed["first_token"] == cpu["first_token"] == disk["first_token"]
    loaded = cpu["cached_tokens"][0] > 0 and disk["cached_tokens"][0] > 0
    hit = cpu["prefix_hit_cached_tokens"][0]
    ok = same and loaded and hit > 0 and recomputed["cached_tokens"][0] == 0
    return ok, (f"{tokens} tokens: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
                + f"; prefix cache served {hit}, tiers {cpu['cached_tokens'][0]} / "
                  f"{disk['cached_tokens'][0]} "
                  f"tokens; same first token: {same}")


def ttft_table(report: common.Report) -> str:
    rows = ["| prompt tokens | prefix cache ms | CPU tier ms | disk tier ms | recomputed ms |",
            "|---|---|---|---|---|"]
    for key, f in report.figures.items():
        if key.startswith("ttft_"):
            rows.append(f"| {key[5:]} | {f['prefix cache']} | {f['CPU tier']} | "
                        f"{f['disk tier']} | {f['recomputed']} |")
    b = report.figures.get("bandwidth")
    if b:
        rows += ["", f"CPU tier: store {b['store_gbs']:.1f} GB/s, load {b['load_gbs']:.1f} "
                     f"GB/s; plain pinned copy_ {b['plain_d2h_gbs']:.1f} / "
                     f"{b['plain_h2d_gbs']:.1f} GB/s (device to host / host to device)."]
    return "\n".join(rows)


def main() -> int:
    args = common.parse_args(__doc__, 120.0)
    args.blocks = 16 if args.quick else 512
    lengths = (256, 1024) if args.quick else (1024, 8192, 32768)
    report = common.Report(NAME, "CPU tier copies and reload time to first token", args)
    work = Path(tempfile.mkdtemp(prefix="kvmem-tier-copies-"))
    # --quick (a CPU shake-out): the tiny Llama; Qwen3-0.6B prefills ~50 tokens/s there
    model = common.tiny_llama(work) if args.quick else common.qwen3_0_6b(work)
    report.say(ANCHOR)
    report.check("CPU tier store and load bandwidth against a plain pinned copy_",
                 lambda: check_bandwidth(args, report))
    report.check("decode steps while the CPU tier stores and loads on its side stream",
                 lambda: check_overlap(args, model, report), needs_s=20)
    report.check("break-even length of a CPU-tier load against recomputing",
                 lambda: check_break_even(args, model, report), needs_s=20)
    for tokens in lengths:
        report.check(f"reload TTFT at {tokens} tokens",
                     lambda tokens=tokens: check_ttft(tokens, args, model, report),
                     needs_s=10 if tokens < 32768 else 40)
    report.notes.append(ANCHOR)
    return report.write(ttft_table(report))


if __name__ == "__main__":
    sys.exit(main())
