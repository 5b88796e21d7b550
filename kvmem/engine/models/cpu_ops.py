"""Fused decoder-layer steps on the CPU (fp32), with the eager torch ops as the fallback.

``add_rms_norm`` adds the residual and normalises in one pass; ``rotary_qk_`` rotates a
fused qkv output's q and k heads in place. Both call ``fused_ops.c`` in the CPU kernel
library when the tensors are fp32 CPU tensors it handles and the library is built
(``kvmem.engine.attention.cpu_kernels``); elsewhere (GPU, bf16, no compiler,
``KVMEM_CPU_KERNELS=0``) they return ``None`` and the caller runs its torch ops.
"""

from __future__ import annotations

import torch

from kvmem.engine.attention import cpu_kernels


def _fused(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) \
        and cpu_kernels.library() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x + residual, rms_norm(x + residual) * weight)`` (or ``(x, rms_norm(x) * weight)``
    without a residual) for ``x`` ``[T, size]``; None where not fused."""
    if x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous() \
            or not _fused(x, weight, *(() if residual is None else (residual,))):
        return None
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=x.dtype)
    if residual is None:
        total, residual_ptr, total_ptr = x, None, None
    else:
        total = torch.empty((rows, size), dtype=x.dtype)
        residual = residual.contiguous()
        residual_ptr, total_ptr = residual.data_ptr(), total.data_ptr()
    cpu_kernels.library().kvmem_add_rms_norm_f32(
        x.data_ptr(), residual_ptr, total_ptr, out.data_ptr(), weight.data_ptr(), rows, size,
        x.stride(0), eps, torch.get_num_threads())
    return total, out


def rotary_qk_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor) -> bool:
    """Rotate the first ``heads`` heads of every row of ``qkv`` ``[T, width]`` in place (q
    heads then k heads); ``cos``/``sin`` ``[T, 1, head_dim]`` fp32. False where not fused."""
    if qkv.dim() != 2 or qkv.stride(1) != 1 or not cos.is_contiguous() \
            or not sin.is_contiguous() or not _fused(qkv, cos, sin):
        return False
    cpu_kernels.library().kvmem_rotary_f32(
        qkv.data_ptr(), qkv.shape[0], qkv.stride(0), heads, head_dim, cos.data_ptr(),
        sin.data_ptr(), torch.get_num_threads())
    return True
