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
    for tokens in lengths:
        report.check(f"reload TTFT at {tokens} tokens",
                     lambda tokens=tokens: check_ttft(tokens, args, model, report),
                     needs_s=10 if tokens < 32768 else 40)
    report.notes.append(ANCHOR)
    return report.write(ttft_table(report))


if __name__ == "__main__":
    sys.exit(main())
