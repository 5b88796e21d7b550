"""Elastic KV memory on a device: pages mapped at start, during a burst and after it, two
engines under one device total, and an injected failed map.

    python benchmarks/gpu/elastic_cuda.py --device cuda --out DIR [--quick]
    python benchmarks/gpu/elastic_cuda.py --device cpu --out DIR --quick   # CPU shake-out

The model is the tests' tiny Llama shape with ``--load-format dummy`` weights. What the
device holds is read outside kvmem: on CUDA ``torch.cuda.mem_get_info`` less what torch's
caching allocator reserves (``memory_reserved``), on the CPU the resident bytes of the
reservation (``/proc/self/smaps``). Checks:

1. startup: before the pre-mapping thread starts only the null block's page is mapped
   (one granule per slot on the device), then the reserve of ``reserve_pages``;
2. burst: after every step, the device's growth since start equals the storage's mapped
   growth within one granule per slot, the ledger entry holds what the storage holds,
   and no page is mapped beyond those with live or cached blocks plus the reserve;
3. after the burst: "back" with prefix caching on means the live blocks are gone
   (only the null block stays live) and wholly free pages beyond the reserve are
   unmapped at once, while pages holding cached blocks stay mapped as prefix cache;
   those go back when asked: a ceiling lowered to one request (``kvmem limit``) unmaps
   them, and the device shows the bytes returned;
4. two engines in two server processes (``benchmarks/elastic_sharing.py``'s servers)
   under ``kvmem limit --total``: each serves its burst alone, then both at once; both
   give their solo tokens, and the sum of what they hold (the ledger, sampled every
   20 ms) never exceeds the total plus the documented one-step overdraft;
5. an injected failed map (``KVMEM_FAULT_MAP``) fails the request with one line naming
   the rank, within a bounded time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402 - puts the repository on sys.path

MiB = common.MiB
NAME = "elastic_cuda"


def device_held(device: str, storage) -> int:
    """Bytes the device holds outside torch's caching allocator (CUDA), or the
    reservation's resident bytes (CPU)."""
    import torch

    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total - free - torch.cuda.memory_reserved(torch.device(device))
    return storage.backend.resident_bytes()


def kept_pages(table) -> int:
    """Pages holding a live or a cached block."""
    with table.cond:
        pages = {p for p, n in enumerate(table.live) if n > 0}
        pages |= {table.geo.page_of(b) for b in table.cached}
    return len(pages)


def ledger_held(ledger_dir: str, device: str, name: str) -> int | None:
    from kvmem.memory.ledger import Ledger

    entry = Ledger.for_device(device, ledger_dir).read().engines.get(name)
    return None if entry is None else entry.mapped_bytes


def check_startup(args, report: common.Report) -> tuple[bool, str]:
    import torch

    from kvmem.memory.elastic import ElasticKVStorage
    from kvmem.memory.storage import SlotShape

    shape = SlotShape(num_kv=2, block_size=16, num_heads=2, head_dim=64)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.device.startswith("cuda"):
        torch.cuda.init()
    storage = None
    before = device_held(args.device, None) if args.device.startswith("cuda") else 0
    storage = ElasticKVStorage(4, shape, dtype, max_blocks=4096, device=args.device,
                               reserve_pages=2, start=False)
    try:
        stats, geo = storage.stats(), storage.geometry
        grown = device_held(args.device, storage) - before
        tol = storage.backend.granularity * geo.num_slots
        report.figure("startup", {"granularity": storage.backend.granularity,
                                  "page_bytes": stats.page_bytes, "reserved_bytes":
                                  stats.reserved_bytes, "mapped_pages": stats.mapped_pages,
                                  "device_grew_bytes": grown})
        if stats.mapped_pages != 1 or abs(grown - stats.page_bytes) > tol:
            return False, (f"{stats.mapped_pages} pages mapped before pre-mapping, the device "
                           f"grew {grown} bytes for a {stats.page_bytes}-byte page")
        storage.start()
        storage.settle()
        after = storage.stats()
        if after.mapped_pages != 1 + 2:
            return False, f"{after.mapped_pages} pages after the reserve of 2 was mapped"
        return True, (f"null page only before pre-mapping ({stats.page_bytes} bytes, device "
                      f"+{grown}), 1 + reserve 2 pages once started, "
                      f"{stats.reserved_bytes / MiB:.0f} MiB reserved")
    finally:
        storage.close()


def make_engine(args, model: str, name: str, **kw):
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=model, load_format="dummy", device=args.device, kv_memory="elastic",
        engine_name=name, max_model_len=args.max_model_len, enforce_eager=True,
        kv_cache_memory_bytes=args.limit_mib * MiB, max_num_batched_tokens=2048, **kw))


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 250) for _ in range(length)] for _ in range(count)]


def burst_samples(engine, args, ledger_dir: str, batch: list[list[int]]) -> list[dict]:
    """Serve ``batch`` step by step; after each step (pages settled) one sample."""
    from kvmem.engine.sampling_params import SamplingParams

    storage = engine.kv_storage
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"burst{i}", p, params)
    samples, deadline = [], time.monotonic() + args.step_deadline_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the burst did not finish within {args.step_deadline_s} s")
        engine.step()
        storage.settle()
        stats = storage.stats()
        samples.append({"mapped": stats.mapped_bytes, "held": stats.held_bytes,
                        "pages": stats.mapped_pages, "live_blocks": stats.live_blocks,
                        "kept_pages": kept_pages(storage.table),
                        "device": device_held(args.device, storage),
                        "ledger": ledger_held(ledger_dir, args.device, "solo")})
    return samples


def check_burst(state: dict, args, report: common.Report) -> tuple[bool, str]:
    engine, ledger_dir = state["engine"], state["ledger_dir"]
    storage = engine.kv_storage
    warm = prompts(9, 1, 64)
    burst_samples(engine, args, ledger_dir, warm)  # kernels and activations allocated
    storage.settle()
    base = {"mapped": storage.stats().mapped_bytes, "device": device_held(args.device, storage)}
    samples = burst_samples(engine, args, ledger_dir, prompts(1, args.requests, args.prompt_len))
    tol = storage.backend.granularity * storage.geometry.num_slots
    worst = max(abs((s["device"] - base["device"]) - (s["mapped"] - base["mapped"]))
                for s in samples)
    ledger_off = [s for s in samples if s["ledger"] != s["held"]]
    beyond = max(s["pages"] - s["kept_pages"] for s in samples)
    peak = max(s["mapped"] for s in samples)
    report.figure("burst", {"steps": len(samples), "base_mapped": base["mapped"],
                            "peak_mapped": peak, "worst_device_vs_mapped_bytes": worst,
                            "tolerance_bytes": tol, "most_pages_beyond_kept": beyond,
                            "samples": samples[:: max(1, len(samples) // 20)]})
    state["peak"] = peak
    ok = worst <= tol and not ledger_off and beyond <= storage.table.reserve_pages \
        and peak > base["mapped"]
    return ok, (f"{len(samples)} steps: mapped {base['mapped'] / MiB:.0f} -> peak "
                f"{peak / MiB:.0f} MiB; device vs mapped off by at most {worst} bytes "
                f"(tolerance {tol}); ledger != held at {len(ledger_off)} samples; at most "
                f"{beyond} pages mapped beyond live/cached ones (reserve "
                f"{storage.table.reserve_pages})")


def check_after_burst(state: dict, args, report: common.Report) -> tuple[bool, str]:
    from kvmem.memory import control

    engine, ledger_dir = state["engine"], state["ledger_dir"]
    storage = engine.kv_storage
    storage.settle()
    idle = storage.stats()
    kept = kept_pages(storage.table)
    idle_device = device_held(args.device, storage)
    one_request = engine.elastic.request_bytes
    control.set_limits("solo", ceiling_bytes=one_request, ledger_dir=ledger_dir)
    deadline = time.monotonic() + 5.0
    while storage.stats().mapped_bytes > one_request and time.monotonic() < deadline:
        time.sleep(0.02)
    storage.settle()
    shrunk = storage.stats()
    returned = idle_device - device_held(args.device, storage)
    freed = idle.mapped_bytes - shrunk.mapped_bytes
    tol = storage.backend.granularity * storage.geometry.num_slots
    live = idle.live_bytes // storage.table.block_bytes  # cached-free blocks excluded
    report.figure("after_burst", {
        "idle_live_blocks": live, "idle_cached_blocks": idle.cached_blocks,
        "idle_mapped_pages": idle.mapped_pages, "idle_kept_pages": kept,
        "ceiling_bytes": one_request, "shrunk_mapped_bytes": shrunk.mapped_bytes,
        "device_returned_bytes": returned, "unmapped_bytes": freed})
    ok = (live == 1 and idle.mapped_pages <= kept + storage.table.reserve_pages
          and idle.mapped_bytes < state["peak"] + tol and shrunk.mapped_bytes <= one_request
          and abs(returned - freed) <= tol)
    return ok, (f"idle: {live} live block (the null block's), {idle.cached_blocks} cached "
                f"blocks keep {kept} pages, {idle.mapped_pages} mapped (reserve "
                f"{storage.table.reserve_pages}); ceiling lowered to one request "
                f"({one_request / MiB:.0f} MiB): mapped {shrunk.mapped_bytes / MiB:.0f} MiB, "
                f"device got back {returned / MiB:.1f} MiB of {freed / MiB:.1f} unmapped")


def check_two_engines(args, work: Path, report: common.Report) -> tuple[bool, str]:
    import asyncio

    import elastic_sharing as es

    from kvmem.memory.ledger import Ledger

    ledger_dir = str(work / "ledger-two")
    opts = es.sharing_options(device=args.device, model=common.tiny_llama(work),
                              load_format="dummy", max_model_len=args.max_model_len,
                              reservation_mib=args.limit_mib, requests=args.requests,
                              dtype="auto")
    servers = [es.start("kvmem", n, opts, ledger_dir, work, tier=False, caching=True,
                        cores="0") for n in ("A", "B")]
    report.cleanups += [s.kill for s in servers]
    try:
        for s in servers:
            s.wait_ready(timeout=min(120, report.left_s()))
        batches = [prompts(11, args.requests, args.prompt_len),
                   prompts(12, args.requests, args.prompt_len)]
        solo = [asyncio.run(es.burst(s, b, args.max_tokens))
                for s, b in zip(servers, batches, strict=True)]
        alone_peak = [ledger_held(ledger_dir, args.device, n) for n in ("A", "B")]
        # both cached their prompts: a total of ~1.2 bursts' pages makes them share
        burst_bytes = max(solo_peak for solo_peak in alone_peak)
        total = int(burst_bytes * 1.2)
        Ledger.for_device(args.device, ledger_dir).set_total_limit(total)
        # the idle engines give back their cached pages down to the new total first
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and sum(
                ledger_held(ledger_dir, args.device, n) or 0 for n in ("A", "B")) > total:
            time.sleep(0.05)

        async def together():
            return await asyncio.gather(*(es.burst(s, b, args.max_tokens)
                                          for s, b in zip(servers, batches, strict=True)))

        with es.LedgerSampler(ledger_dir) as sampler:
            shared = asyncio.run(together())
        held = [sum(v for v in s.values()) for _, s in sampler.samples]
        overdraft = args.overdraft_bytes
        same = [a["texts"] == b["texts"] for a, b in zip(solo, shared, strict=True)]
        report.figure("two_engines", {"total_bytes": total, "max_held_together": max(held),
                                      "overdraft_bound_bytes": overdraft,
                                      "samples": len(held), "same_tokens": same,
                                      "timeline_mib": sampler.timeline(0.5)})
        ok = all(same) and max(held) <= total + overdraft and len(held) > 0
        return ok, (f"total {total / MiB:.0f} MiB: held together at most "
                    f"{max(held) / MiB:.1f} MiB over {len(held)} samples (bound total + "
                    f"{overdraft / MiB:.0f} MiB overdraft); solo tokens again: {same}")
    finally:
        for s in servers:
            s.kill()


def check_failed_map(args, work: Path) -> tuple[bool, str]:
    """A map that fails mid-burst: one line naming the rank, within the step deadline."""
    os.environ["KVMEM_FAULT_MAP"] = "after=40"  # startup's pages pass, the burst's fail
    try:
        engine = make_engine(args, common.tiny_llama(work), "faulty")
    finally:
        del os.environ["KVMEM_FAULT_MAP"]
    began = time.monotonic()
    try:
        burst_samples(engine, args, str(work / "ledger"), prompts(3, args.requests,
                                                                  args.prompt_len))
        return False, "the burst finished although maps were failing"
    except Exception as e:  # the failure under test
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        took = time.monotonic() - began
        ok = "rank 0" in line and "\n" not in str(e).strip()
        return ok, f"{type(e).__name__} after {took:.1f} s: {line}"
    finally:
        engine.shutdown()


def start_solo(state: dict, args, work: Path) -> tuple[bool, str]:
    from kvmem.engine.config import EngineConfig

    engine = state["engine"] = make_engine(args, common.tiny_llama(work), "solo")
    geo = engine.kv_storage.geometry
    # docs/elastic-memory.md: at most one step's blocks (the servers' default step of
    # max_num_batched_tokens), in whole pages, plus the page a step's last block opens
    step_blocks = EngineConfig().max_num_batched_tokens // 16
    args.overdraft_bytes = (-(-step_blocks // geo.blocks_per_page) + 1) * geo.page_bytes
    return True, (f"{geo.num_slots} slots, pages of {geo.page_bytes} bytes "
                  f"({geo.blocks_per_page} blocks)")


def main() -> int:
    args = common.parse_args(__doc__, 90.0)
    quick = args.quick
    args.max_model_len = 1024 if quick else 4096
    args.requests, args.prompt_len = (6, 300) if quick else (16, 3000)
    args.max_tokens = 4 if quick else 8
    args.limit_mib = 16 if quick else 256
    args.step_deadline_s = 60.0
    args.overdraft_bytes = 0  # set once the engine's page size is known
    report = common.Report(NAME, "Elastic KV memory on the device", args)
    work = Path(tempfile.mkdtemp(prefix="kvmem-elastic-cuda-"))
    ledger_dir = str(work / "ledger")
    os.environ["KVMEM_LEDGER_DIR"] = ledger_dir
    report.check("startup maps only the null page before pre-mapping",
                 lambda: check_startup(args, report))
    state: dict = {"ledger_dir": ledger_dir}
    try:
        if report.check("an elastic engine starts",
                        lambda: start_solo(state, args, work)):
            report.check("mapped bytes follow live blocks during a burst",
                         lambda: check_burst(state, args, report), needs_s=10)
            report.check("pages go back after the burst",
                         lambda: check_after_burst(state, args, report), needs_s=5)
    finally:
        if "engine" in state:
            state["engine"].shutdown()
    report.check("two engines under one device total",
                 lambda: check_two_engines(args, work, report), needs_s=30)
    report.check("an injected failed map fails in one line naming the rank",
                 lambda: check_failed_map(args, work), needs_s=10)
    report.notes.append("'Back' with prefix caching on: live blocks end with their requests "
                        "and wholly free pages beyond the reserve are unmapped at once; pages "
                        "holding cached blocks stay mapped until a lower ceiling or another "
                        "engine's ask evicts them (then the device gets them back).")
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
