"""The Triton kernels compile for a Hopper GPU (sm_90) here, without one.

Triton's CPU interpreter runs the kernels' arithmetic (tests/test_attention.py) but accepts
code the GPU compiler refuses (a plain module global read in a kernel did so), so every
variant the engine launches is also compiled ahead of time to a cubin: Triton ships the
NVIDIA backend and ptxas, and compiling needs no device.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvmem.engine.attention import triton_backend as tb  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STRIDES = ["s_qt", "s_qh", "s_ot", "s_oh", "s_cb", "s_ckv", "s_ct", "s_ch", "s_bt"]


def compile_for_hopper(fn, signature: dict[str, str], constexprs: dict[str, object]):
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=HOPPER)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("window", [False, True], ids=["full", "sliding"])
def test_paged_attention_kernel_compiles(dtype, window):
    pointers = {"Q": dtype, "Out": dtype, "Cache": dtype, "BlockTables": "i32",
                "QueryStart": "i32", "SeqLens": "i32"}
    signature = {name: f"*{t}" for name, t in pointers.items()}
    signature |= {"scale": "fp32", **{s: "i32" for s in STRIDES}, "window": "i32"}
    kernel = compile_for_hopper(tb._paged_attention_kernel, signature, dict(
        QUERIES_PER_KV=2, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=tb.BLOCK_M,
        HAS_WINDOW=window, DOT_PRECISION=tb._dot_precision(TORCH_DTYPES[dtype])))
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_store_kv_kernel_compiles(dtype):
    signature = {"K": f"*{dtype}", "V": f"*{dtype}", "Cache": f"*{dtype}", "Slots": "*i64"}
    signature |= {s: "i32" for s in ["s_kt", "s_kh", "s_vt", "s_vh", "s_cb", "s_ckv", "s_ct",
                                     "s_ch"]}
    kernel = compile_for_hopper(tb._store_kv_kernel, signature,
                                dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16))
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("window", [False, True], ids=["full", "sliding"])
def test_decode_kernels_compile(dtype, window):
    pointers = {"Q": dtype, "PartAcc": "fp32", "PartML": "fp32", "Cache": dtype,
                "BlockTables": "i32", "SeqLens": "i32"}
    signature = {name: f"*{t}" for name, t in pointers.items()}
    strides = ["s_qt", "s_qh", "s_cb", "s_ckv", "s_ct", "s_ch", "s_bt"]
    signature |= {"scale": "fp32", **{s: "i32" for s in strides}, "window": "i32",
                  "blocks_per_split": "i32"}
    decode = compile_for_hopper(tb._paged_decode_kernel, signature, dict(
        QUERIES_PER_KV=2, NUM_HEADS=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_H=16,
        NUM_SPLITS=8, BLOCKS_PER_TILE=tb.DECODE_BLOCKS_PER_TILE, HAS_WINDOW=window,
        DOT_PRECISION=tb._dot_precision(TORCH_DTYPES[dtype])))
    merge = compile_for_hopper(
        tb._decode_merge_kernel,
        {"PartAcc": "*fp32", "PartML": "*fp32", "Out": f"*{dtype}", "s_ot": "i32",
         "s_oh": "i32"}, dict(NUM_HEADS=16, HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=8))
    assert decode.asm["cubin"] and merge.asm["cubin"]


def test_decode_splits_fill_the_device_without_empty_work():
    assert tb.decode_splits(256, 8, 128, 4 * 132) == (1, 128)  # a full batch: no split
    assert tb.decode_splits(1, 8, 2048, 4 * 132) == (16, 128)  # one long context: 16 ways
    assert tb.decode_splits(2, 1, 3, 64) == (4, 1)  # at most the blocks, rounded up to pow2
