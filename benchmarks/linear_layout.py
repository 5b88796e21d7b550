"""Row-major against column-major linear weights on the CPU (run by hand, not a test).

Times ``F.linear`` over the four projections of every layer of SmolLM2-135M (30 layers:
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576; random fp32 weights) for a
range of row counts, with the weights as loaded (``[out, in]`` row-major) and as the
engine keeps them after loading (the same ``[out, in]`` tensor laid out column-major, see
``kvmem.engine.models.layers.store_weight_column_major``). Both layouts run in the same
process, alternating, best of 3.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_layout.py [--layers 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def run(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    args = p.parse_args()
    torch.set_num_threads(1)
    row_major = [torch.randn(n, k) for _ in range(args.layers) for n, k in SHAPES]
    column_major = [w.t().contiguous().t() for w in row_major]
    print(f"{'rows':>6} {'row-major':>12} {'column-major':>14} {'speed-up':>9}")
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for _, k in SHAPES}
        reps = max(2, 64 // max(1, m // 32))
        run(row_major, inputs, 1), run(column_major, inputs, 1)
        a, b = float("inf"), float("inf")
        for _ in range(3):
            a = min(a, run(row_major, inputs, reps))
            b = min(b, run(column_major, inputs, reps))
        print(f"{m:>6} {a * 1e3:>9.1f} ms {b * 1e3:>11.1f} ms {a / b:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
