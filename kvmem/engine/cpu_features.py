"""What this CPU can run, asked at run time, for kvmem's CPU fast paths.

Every CPU-specific choice asks here: the C kernels' target (``march``), the AVX-512 BF16
decode GEMM, AMX, and whether oneDNN can run bf16 GEMMs (it needs AVX-512 BW/VL/DQ or
AVX-NE-CONVERT; torch answers, and on an AVX2-only CPU such as AMD's Zen 3 it says no).
Each path without its feature falls back to one this CPU runs.

``KVMEM_CPU_ISA=avx2`` makes kvmem treat the CPU as AVX2-only (x86-64-v3) whatever it has:
the kernels are built for x86-64-v3, and the AVX-512, AVX-512 BF16, AMX and oneDNN bf16
paths are off. The fallbacks can then be run, and tested, on any x86-64 CPU. (torch's own
kernels follow ``ATEN_CPU_CAPABILITY=avx2``, oneDNN's ``ONEDNN_MAX_CPU_ISA=AVX2``.)
``native`` (the default) uses what the CPU has.
"""

from __future__ import annotations

import functools
import os

import torch

from kvmem.errors import ConfigError

ENV = "KVMEM_CPU_ISA"
ISAS = {"native": "native", "avx2": "x86-64-v3"}  # the setting -> the compiler's -march


@functools.cache
def isa() -> str:
    """The ``KVMEM_CPU_ISA`` setting: ``native`` or ``avx2``."""
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in ISAS:
        raise ConfigError(f"{ENV} must be one of {', '.join(ISAS)}, not {value!r}")
    return value


def capped() -> bool:
    """Whether kvmem treats this CPU as AVX2-only (``KVMEM_CPU_ISA=avx2``)."""
    return isa() == "avx2"


def march() -> str:
    """The ``-march`` the C kernels are built for."""
    return ISAS[isa()]


def _torch_says(name: str) -> bool:
    check = getattr(torch.cpu, name, None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


@functools.cache
def amx() -> bool:
    """AMX tiles (bf16 GEMMs faster than fp32 ones)."""
    return not capped() and _torch_says("_is_amx_tile_supported")


@functools.cache
def avx512_bf16() -> bool:
    """AVX-512 BF16 (``VDPBF16PS``: kvmem's bf16 decode GEMM)."""
    return not capped() and _torch_says("_is_avx512_bf16_supported")


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (torch's own check)."""
    if capped():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def describe() -> str:
    """One line for logs and reports: torch's dispatch level and kvmem's choices."""
    level = torch.backends.cpu.get_cpu_capability()
    return (f"torch {level}, kvmem kernels -march={march()}, AMX {'yes' if amx() else 'no'}, "
            f"oneDNN bf16 {'yes' if onednn_bf16() else 'no'}")
