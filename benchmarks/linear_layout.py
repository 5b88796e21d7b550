"""CPU linear layers: row-major, column-major and MKL-packed fp32 weights (run by hand).

Times the four projections of every layer of SmolLM2-135M (30 layers: qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576) and its LM head (576->49,152) with random
fp32 weights for a range of row counts: ``F.linear`` on the weights as loaded (``[out,
in]`` row-major) and laid out column-major (the engine's fallback,
``kvmem.engine.models.layers.store_weight_column_major``), and MKL's packed GEMM on the
weights packed once (what the engine keeps, ``kvmem.engine.models.packed_gemm``). All
run in the same process, alternating, best of 3; the ratios are speed-ups.

``--bf16`` times the same shapes with bf16 weights as the engine keeps them on a CPU
without AMX: MKL's packed fp32 copy against the bf16 kernel (``bf16_gemm.c``, AVX-512
BF16) that takes batches of up to ``packed_gemm.SMALL_BF16_ROWS`` rows.

``--onednn`` times the two backends the engine chooses between at start-up
(``packed_gemm.backend``), for fp32 and bf16 weights: MKL's packed fp32 (with the bf16
kernel for small bf16 batches) against oneDNN's reordered weights in their own dtype.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_layout.py [--layers 30]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_layout.py --bf16 --rows 1 4 8 16
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_layout.py --onednn
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
from kvmem.engine.models import onednn_gemm, packed_gemm  # noqa: E402

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
    p.add_argument("--bf16", action="store_true",
                   help="bf16 weights: packed fp32 copy against the bf16 decode kernel")
    p.add_argument("--onednn", action="store_true",
                   help="MKL's packed GEMM against oneDNN's, fp32 and bf16 weights")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not packed_gemm.available():
        sys.exit("this torch build exports no MKL packed GEMM")
    if args.bf16:
        bf16_kernel(args.layers, args.rows)
        return
    if args.onednn:
        mkl_against_onednn(args.layers, args.rows)
        return
    row_major = [torch.randn(n, k) for _ in range(args.layers) for n, k in SHAPES]
    row_major.append(torch.randn(*LM_HEAD))
    column_major = [w.t().contiguous().t() for w in row_major]
    packed = [packed_gemm.pack_mkl(w) for w in row_major]
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


def bf16_kernel(layers: int, rows: list[int]) -> None:
    if not packed_gemm.bf16_kernel_available():
        sys.exit("no AVX-512 BF16 kernel on this CPU")
    if not packed_gemm.bf16_as_fp32():
        sys.exit("bf16 weights are not packed as fp32 here (AMX, or KVMEM_CPU_BF16_WEIGHTS)")
    shapes = [s for _ in range(layers) for s in SHAPES] + [LM_HEAD]
    packed = [packed_gemm.pack_mkl(torch.randn(n, k).bfloat16()) for n, k in shapes]
    paths = {  # both return bf16, as the engine's projections do
        "packed fp32": lambda x: [packed_gemm.linear(x[w.in_features].float(), w)
                                  .bfloat16() for w in packed],
        "bf16 kernel": lambda x: [packed_gemm.linear(x[w.in_features], w) for w in packed],
    }
    weight_gb = sum(n * k for n, k in shapes) * 2 / 1e9
    print(f"{'rows':>6}" + "".join(f"{name:>15}" for name in paths)
          + "  speed-up  bf16 weights read")
    for m in rows:
        if m > packed_gemm.SMALL_BF16_ROWS:
            sys.exit(f"the bf16 kernel takes up to {packed_gemm.SMALL_BF16_ROWS} rows")
        inputs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}
        times = {}
        for name, fn in paths.items():
            fn(inputs)
            times[name] = best_of(lambda fn=fn, x=inputs: fn(x), 4)
        fp32, bf16 = times["packed fp32"], times["bf16 kernel"]
        print(f"{m:>6}" + "".join(f"{t * 1e3:>12.1f} ms" for t in times.values())
              + f"  {fp32 / bf16:>7.2f}x  {weight_gb / bf16:>9.1f} GB/s", flush=True)


def mkl_against_onednn(layers: int, rows: list[int]) -> None:
    if not onednn_gemm.available():
        sys.exit("this torch build has no oneDNN linear")
    shapes = [s for _ in range(layers) for s in SHAPES] + [LM_HEAD]
    print(f"{'dtype':>9} {'rows':>6} {'MKL packed':>12} {'oneDNN':>12}  oneDNN speed-up")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k).to(dtype) for n, k in shapes]
        backends = {"mkl": [packed_gemm.pack_mkl(w) for w in weights],
                    "onednn": [onednn_gemm.pack(w) for w in weights]}
        del weights
        for m in rows:
            inputs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
            times = {}
            for name, packed in backends.items():
                def run(packed=packed, x=inputs):
                    return [packed_gemm.linear(x[w.in_features], w) for w in packed]
                run()
                times[name] = best_of(run, max(2, 16 // max(1, m // 32)))
            print(f"{str(dtype).removeprefix('torch.'):>9} {m:>6} {times['mkl'] * 1e3:>9.1f} ms"
                  f" {times['onednn'] * 1e3:>9.1f} ms  {times['mkl'] / times['onednn']:>14.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
