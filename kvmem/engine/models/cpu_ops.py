"""Fused decoder-layer steps on the CPU (fp32 and bf16), with the eager torch ops as the
fallback.

``add_rms_norm`` adds the residual and normalises in one pass; ``rotary_qk_`` rotates a
fused qkv output's q and k heads in place; ``silu_mul`` applies a gated MLP's activation to
the fused gate/up output. They call ``fused_ops.c`` and ``activation.c`` in the CPU kernel
library when the tensors are CPU tensors of a dtype they handle and the library is built
(``kvmem.engine.attention.cpu_kernels``); elsewhere (GPU, other dtypes, no compiler,
``KVMEM_CPU_KERNELS=0``) they return ``None`` and the caller runs its torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from kvmem.engine.attention import cpu_kernels

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(name: str, x: torch.Tensor, *others: torch.Tensor) -> ctypes._CFuncPtr | None:
    """``kvmem_{name}_{dtype}`` for ``x``'s dtype, if every tensor is on the CPU and ``x``'s
    dtype has one (``others`` must share it), else None."""
    suffix = _SUFFIX.get(x.dtype)
    if suffix is None or x.device.type != "cpu" \
            or any(t.device.type != "cpu" or t.dtype != x.dtype for t in others):
        return None
    library = cpu_kernels.library()
    return None if library is None else getattr(library, f"kvmem_{name}_{suffix}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x + residual, rms_norm(x + residual) * weight)`` (or ``(x, rms_norm(x) * weight)``
    without a residual) for ``x`` ``[T, size]``; None where not fused."""
    if x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    kernel = _kernel("add_rms_norm", x, weight, *(() if residual is None else (residual,)))
    if kernel is None:
        return None
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=x.dtype)
    if residual is None:
        total, residual_ptr, total_ptr = x, None, None
    else:
        total = torch.empty((rows, size), dtype=x.dtype)
        residual = residual.contiguous()
        residual_ptr, total_ptr = residual.data_ptr(), total.data_ptr()
    kernel(x.data_ptr(), residual_ptr, total_ptr, out.data_ptr(), weight.data_ptr(), rows, size,
           x.stride(0), eps, torch.get_num_threads())
    return total, out


def rotary_qk_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor) -> bool:
    """Rotate the first ``heads`` heads of every row of ``qkv`` ``[T, width]`` in place (q
    heads then k heads); ``cos``/``sin`` ``[T, 1, head_dim]`` in ``qkv``'s dtype. False where
    not fused."""
    if qkv.dim() != 2 or qkv.stride(1) != 1 or not cos.is_contiguous() \
            or not sin.is_contiguous():
        return False
    kernel = _kernel("rotary", qkv, cos, sin)
    if kernel is None:
        return False
    kernel(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), heads, head_dim, cos.data_ptr(),
           sin.data_ptr(), torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * inter]`` (gate first), as a new dense
    ``[T, inter]``; None where not fused."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    kernel = _kernel("silu_mul", gate_up)
    if kernel is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(),
           torch.get_num_threads())
    return out
