"""CPU linear layers: row-major, column-major and MKL-packed fp32 weights (run by hand).

Times the four projections of every layer of SmolLM2-135M (30 layers: qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576) and its LM head (576->49,152) with random
fp32 weights for a range of row counts: ``F.linear`` on the weights as loaded (``[out,
in]`` row-major) and laid out column-major (the engine's fallback,
``kvmem.engine.models.layers.store_weight_column_major``), and MKL's packed GEMM on the
weights packed once (what the engine keeps, ``kvmem.engine.models.packed_gemm``). All
run in the same process, alternating, best of 3; the ratios are speed-ups.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_layout.py [--layers 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvmem.engine.models import packed_gemm  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def best_of(fn: Callable[[], None], reps: int, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    args = p.parse_args()
    torch.set_num_threads(1)
    if not packed_gemm.available():
        sys.exit("this torch build exports no MKL packed GEMM")
    row_major = [torch.randn(n, k) for _ in range(args.layers) for n, k in SHAPES]
    row_major.append(torch.randn(*LM_HEAD))
    column_major = [w.t().contiguous().t() for w in row_major]
    packed = [packed_gemm.pack(w) for w in row_major]
    layouts = {
        "row-major": lambda x: [F.linear(x[w.shape[1]], w) for w in row_major],
        "column-major": lambda x: [F.linear(x[w.shape[1]], w) for w in column_major],
        "packed": lambda x: [packed_gemm.linear(x[w.in_features], w) for w in packed],
    }
    print(f"{'rows':>6}" + "".join(f"{name:>15}" for name in layouts)
          + "  column-major vs row-major  packed vs column-major")
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for _, k in SHAPES}
        reps = max(2, 64 // max(1, m // 32))
        times = {}
        for name, fn in layouts.items():
            fn(inputs)
            times[name] = best_of(lambda fn=fn, x=inputs: fn(x), reps)
        col = times["column-major"]
        print(f"{m:>6}" + "".join(f"{t * 1e3:>12.1f} ms" for t in times.values())
              + f"  {times['row-major'] / col:>24.2f}x {col / times['packed']:>22.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
