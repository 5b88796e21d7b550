"""Tensor parallel 2 with elastic KV memory, both ranks on one device (MISSION problem 4's
shape: an elastic KV cache that hung at tensor-parallel start-up).

    python benchmarks/gpu/tp_elastic_cuda.py --device cuda --out DIR [--quick]
    python benchmarks/gpu/tp_elastic_cuda.py --device cpu --out DIR --quick   # CPU shake-out

NCCL refuses two ranks on one GPU, so the ranks' collectives go through gloo
(``--distributed-backend gloo``, which copies a step's CUDA tensors through host memory).
The model is the tests' tiny Llama shape with ``--load-format dummy`` weights, which are
the same at tp 1 and tp 2 (each rank keeps its shard of the whole drawn matrix). Checks:

1. with the default backend on a one-GPU machine, tp 2 is refused in one line naming the
   rank that has no device (NCCL cannot put two ranks on one device);
2. tp 2 elastic starts within a bounded time; every rank's layout (rank, tp rank, world
   size) is the one the engine's configuration gave it, and rank 0's storage knows its
   rank and world size from the same; rank 0's null page is mapped and its pre-mapping
   thread runs only after the startup map every rank replayed (the order itself is
   tested on the CPU in tests/test_elastic_startup.py);
3. greedy tokens (fp32) at tp 2 equal those of tp 1 for the same dummy weights;
4. an injected failed map on rank 1 (``KVMEM_FAULT_MAP=rank=1,...``) stops the engine with
   one line naming rank 1, within a bounded time; nothing hangs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402 - puts the repository on sys.path

NAME = "tp_elastic_cuda"
MiB = common.MiB


def engine_options(args, tp: int) -> dict:
    backend = "gloo" if args.device.startswith("cuda") and tp > 1 else "auto"
    return {"load_format": "dummy", "device": args.device, "dtype": "float32",
            "kv_memory": "elastic", "kv_cache_memory_bytes": args.limit_mib * MiB,
            "max_model_len": 1024, "tensor_parallel_size": tp, "enforce_eager": True,
            "distributed_backend": backend, "distributed_timeout_s": 30.0}


def prompts(count: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(5)
    return [[rng.randrange(10, 250) for _ in range(length)] for _ in range(count)]


def greedy(llm, args) -> list[list[int]]:
    from kvmem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts(args.requests, args.prompt_len), params)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_nccl_refusal(args, model: str) -> tuple[bool, str]:
    import torch

    from kvmem.engine.llm import LLM
    from kvmem.errors import ConfigError

    if not args.device.startswith("cuda"):
        return None, "not a CUDA device: the default backend is gloo here (nothing to refuse)"
    if torch.cuda.device_count() != 1:
        return None, f"{torch.cuda.device_count()} GPUs: each rank has its own"
    try:
        LLM(model, **{**engine_options(args, 2), "distributed_backend": "auto"})
    except ConfigError as e:
        line = str(e)
        return "rank 1" in line and "\n" not in line, f"refused: {line}"
    return False, "tp 2 with NCCL on one GPU started"


def check_startup(state: dict, args, model: str, report: common.Report) -> tuple[bool, str]:
    from kvmem.engine.llm import LLM

    began = time.monotonic()
    llm = state["tp2"] = LLM(model, **engine_options(args, 2))
    ready_s = report.figure("tp2_ready_s", round(time.monotonic() - began, 2))
    engine = llm.engine
    allocations = engine.parallel.state.allocations
    layout = [(a.rank, a.tp_rank) for a in allocations]
    storage = engine.kv_storage
    premap = storage._premap
    page0 = storage.table.state[storage.geometry.page_of(0)].name
    report.figure("tp2_layout", {"ranks": layout, "storage_rank": storage.rank,
                                 "storage_world_size": storage.world_size,
                                 "null_page": page0, "premap_alive":
                                 premap is not None and premap.alive})
    ok = (layout == [(0, 0), (1, 1)] and (storage.rank, storage.world_size) == (0, 2)
          and page0 == "MAPPED" and premap is not None and premap.alive
          and ready_s < args.ready_bound_s)
    return ok, (f"ready in {ready_s:.1f} s (bound {args.ready_bound_s:g} s); ranks (rank, "
                f"tp rank) {layout}; rank 0's storage: rank {storage.rank} of "
                f"{storage.world_size}, null page {page0.lower()}, pre-mapping "
                f"{'running' if premap is not None and premap.alive else 'not running'}")


def check_tokens(state: dict, args, model: str, report: common.Report) -> tuple[bool, str]:
    from kvmem.engine.llm import LLM

    tp2 = greedy(state["tp2"], args)
    state["tp2"].engine.shutdown()
    state.pop("tp2")
    tp1_llm = LLM(model, **engine_options(args, 1))
    try:
        tp1 = greedy(tp1_llm, args)
    finally:
        tp1_llm.engine.shutdown()
    same = sum(a == b for a, b in zip(tp1, tp2, strict=True))
    first_diff = next((i for i, (a, b) in enumerate(zip(tp1[0], tp2[0], strict=True))
                       if a != b), None)
    report.figure("tokens", {"tp1": tp1[:2], "tp2": tp2[:2], "same_requests": same})
    return same == len(tp1), (f"{same}/{len(tp1)} requests with identical greedy tokens "
                              f"({args.max_tokens} each); first request differs at "
                              f"{first_diff}")


def check_failed_map(args, model: str, report: common.Report) -> tuple[bool, str]:
    from kvmem.engine.llm import LLM

    # startup maps 3 pages (the null block's and a reserve of 2) in each of the 4 slots; a
    # burst of 32 x 900 tokens needs several more pages even at a GPU's 2 MiB granules
    os.environ["KVMEM_FAULT_MAP"] = "rank=1,after=20"
    try:
        llm = LLM(model, **engine_options(args, 2))
    finally:
        del os.environ["KVMEM_FAULT_MAP"]
    began = time.monotonic()
    burst = argparse.Namespace(**{**vars(args), "requests": 32, "prompt_len": 900,
                                  "max_tokens": 2})
    try:
        greedy(llm, burst)
        return False, "the burst finished although rank 1's maps were failing"
    except Exception as e:  # the failure under test
        line = str(e).strip()
        took = report.figure("failed_map_s", round(time.monotonic() - began, 2))
        ok = "rank 1" in line and "\n" not in line
        return ok, f"{type(e).__name__} after {took:.1f} s: {line}"
    finally:
        llm.engine.shutdown()


def main() -> int:
    args = common.parse_args(__doc__, 90.0)
    args.requests, args.prompt_len = (4, 200) if args.quick else (8, 600)
    args.max_tokens = 8 if args.quick else 16
    args.limit_mib = 16 if args.quick else 128
    args.ready_bound_s = 60.0
    report = common.Report(NAME, "Tensor parallel 2 with elastic KV memory on one device",
                           args)
    model = common.tiny_llama(Path(tempfile.mkdtemp(prefix="kvmem-tp-elastic-")))
    os.environ.setdefault("KVMEM_LEDGER_DIR", tempfile.mkdtemp(prefix="kvmem-ledger-"))
    report.check("NCCL refuses two ranks on one GPU in one line", lambda:
                 check_nccl_refusal(args, model))
    state: dict = {}
    try:
        if report.check("tp 2 elastic starts: ranks from the config, null page first",
                        lambda: check_startup(state, args, model, report), needs_s=20):
            report.check("greedy tokens of tp 2 equal tp 1's",
                         lambda: check_tokens(state, args, model, report), needs_s=15)
    finally:
        if "tp2" in state:
            state["tp2"].engine.shutdown()
    report.check("a failed map on rank 1 stops the engine in one line naming rank 1",
                 lambda: check_failed_map(args, model, report), needs_s=15)
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
