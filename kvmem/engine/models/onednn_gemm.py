"""CPU projections on oneDNN's GEMM with the weight reordered once, after loading.

PyTorch's x86 CPU build ships oneDNN and exposes its linear layer with a weight laid out
in advance (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what
Inductor's frozen CPU graphs call). It keeps the weight in its own dtype: bf16 weights stay
bf16 (2 bytes a weight) and run on the CPU's bf16 instructions, accumulating in fp32.

Whether it is faster than MKL's packed fp32 GEMM depends on the CPU: on an AMD EPYC with
AVX-512 BF16, SmolLM2's projections ran 1.45-2.4x faster in fp32 than on MKL's (which
takes a generic path on CPUs not made by Intel), and with bf16 weights 4-5x faster from 32
rows up and 0.93-1.24x the bf16 decode kernel at 1-16 rows
(``benchmarks/linear_layout.py --onednn``). ``packed_gemm.backend`` takes it on such
CPUs, and on Intel's times both once per process and dtype and picks.

From two rows up a row's result does not depend on the other rows of the batch (a single
row takes another path, as with MKL).

oneDNN's bf16 GEMM needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU
(AMD's Zen 3, say) ``available(torch.bfloat16)`` is False and ``pack`` declines bf16
weights, which then run on MKL's fp32 GEMM (``packed_gemm``).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from kvmem.engine import cpu_features

_threads = threading.local()  # whether this thread's OpenMP count was set from torch's


@functools.cache
def _linear_ops() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available()) and ops is not None \
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
    except (RuntimeError, AttributeError):
        return False


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's linear with a reordered weight, and this CPU
    runs it for ``dtype`` weights (fp32 everywhere; bf16 where ``cpu_features`` says so)."""
    if dtype not in (torch.float32, torch.bfloat16) or not _linear_ops():
        return False
    return dtype == torch.float32 or cpu_features.onednn_bf16()


@dataclass(frozen=True)
class OneDNNWeight:
    """A weight ``[out_features, in_features]`` in oneDNN's layout, in its own dtype."""

    buffer: torch.Tensor  # opaque oneDNN tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.buffer.element_size()


def pack(weight: torch.Tensor) -> OneDNNWeight | None:
    """``weight`` (fp32, or bf16 where the CPU runs it; on the CPU) reordered for
    ``x @ weight.T``, else None."""
    if not available(weight.dtype) or weight.device.type != "cpu" or weight.dim() != 2 \
            or weight.numel() == 0:
        return None
    n, k = weight.shape
    buffer = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return OneDNNWeight(buffer, n, k)


def linear(x: torch.Tensor, weight: OneDNNWeight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for the reordered ``W``; ``x`` in the weight's dtype
    (another dtype is converted and the result converted back)."""
    if x.device.type != "cpu" or not x.dtype.is_floating_point:
        raise TypeError(f"a oneDNN weight takes floating-point CPU inputs, not {x.dtype} on "
                        f"{x.device.type}")
    k = weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight takes {k}")
    if not getattr(_threads, "ready", False):
        # a new thread starts with OpenMP's default (every core) until torch sets its own
        torch.get_num_threads()
        _threads.ready = True
    # each torch call costs microseconds and a decode step makes over a hundred of these:
    # the common case (2-d rows in the weight's dtype) makes only the GEMM's
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    if rows.stride(-1) != 1 or rows.stride(0) < k:  # rows of a wider tensor need no copy
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.to(weight.dtype)
    if rows.shape[0] == 0:
        out = rows.new_empty((0, weight.out_features))
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, weight.buffer, bias, "none", [], "")
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)
