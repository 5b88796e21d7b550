"""CPU projections on MKL's packed GEMM: each weight is packed once, after loading.

``F.linear`` hands MKL the weight matrix afresh on every call, and MKL lays it out into its
own panels each time. PyTorch's x86 CPU build links MKL and exports its packed-GEMM API
(``cblas_sgemm_pack`` / ``cblas_sgemm_compute``), so a weight can be laid out once at load
time and reused by every step: up to 1.4x faster than ``F.linear`` on column-major weights
for this family's projections, most at decode batch sizes, and within noise of it at its
worst sizes (1 and 48-64 rows; ``benchmarks/linear_layout.py``). Results equal
``F.linear`` on a column-major weight bit for bit from 2 rows up; a single row differs in
the last bits (MKL's GEMV path).

The packed copy replaces the weight's storage (the parameter keeps its name, dtype and an
empty tensor), so the model holds one copy of each projection, as before. MKL sizes the
buffer for its largest layout; only the part it writes becomes resident.

bf16 weights are packed as fp32 on CPUs without AMX, where a bf16 GEMM runs slower than
an fp32 one (AVX-512 BF16 only: oneDNN's bf16 linear took 5.35 s against 3.0 s in fp32 for
SmolLM2's projections at 2,048 rows). The values are the same (bf16 widens to fp32
exactly), the product accumulates in fp32 and is rounded to bf16 as a bf16 GEMM's is, but
these weights take twice the memory; ``KVMEM_CPU_BF16_WEIGHTS=bf16`` keeps them in bf16.
Where the CPU has AVX-512 BF16, such a weight also keeps its bf16 copy, and batches of up
to ``SMALL_BF16_ROWS`` rows (decode steps, bound by reading the weight) run on it
(``bf16_gemm.c``): half the bytes to read, products exact and summed in fp32 as above, in
another order.

On CPUs not made by Intel, where MKL takes a generic path, ``pack`` returns oneDNN's
reordered weight (``onednn_gemm``) instead; on Intel's, ``backend`` times both once per
process and dtype (about 0.1 s) and takes oneDNN where it is clearly faster.
``KVMEM_CPU_GEMM=mkl|onednn`` overrides the choice. bf16 weights stay bf16 on oneDNN only
where the CPU runs its bf16 GEMM (``kvmem.engine.cpu_features.onednn_bf16``); on an
AVX2-only CPU they are widened to fp32 and take the fp32 weights' backend (oneDNN on CPUs
not made by Intel, as above), the product rounded once to bf16.

Where the API is missing (no MKL: ARM, macOS), for other dtypes and devices, and with
``KVMEM_CPU_KERNELS=0``, ``pack`` returns None and the layer keeps its weight.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmem.engine import cpu_features
from kvmem.engine.attention import cpu_kernels
from kvmem.engine.models import onednn_gemm
from kvmem.engine.models.onednn_gemm import OneDNNWeight
from kvmem.errors import ConfigError

log = logging.getLogger("kvmem.engine")

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count MKL is told to expect when packing: a layout packed for 256 rows was the
# fastest over 1-1,000 rows of the measured shapes (packing for 32 is slower past 32 rows).
_PACK_ROWS = 256

_threads = threading.local()  # the MKL thread count set on this thread
SMALL_BF16_ROWS = 16
_BF16_ROW_GROUP = 8  # rows per pass of bf16_gemm.c (ROWS)
# oneDNN is chosen only when clearly faster, so that close timings on a noisy machine do
# not flip the numerics from one process to the next.
ONEDNN_MARGIN = 1.25
_PROBE_SHAPE = (1024, 1024)  # [out, in] of the weight timed to choose a backend
_PROBE_ROWS = (8, 64, 256)  # a decode step, a small and a larger prefill chunk


@functools.cache
def _load() -> ctypes.CDLL | None:
    if not cpu_kernels.enabled():
        return None
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        get_size, pack_b, compute = (lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack,
                                     lib.cblas_sgemm_compute)
        set_threads = lib.mkl_set_num_threads_local
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size.argtypes, get_size.restype = [i, i, i, i], ctypes.c_size_t
    pack_b.argtypes, pack_b.restype = [i, i, i, i, i, i, f, p, i, p], None
    compute.argtypes, compute.restype = [i, i, i, i, i, i, p, i, p, i, f, p, i], None
    # this build exports one entry for the C and Fortran names: it takes the count by address
    set_threads.argtypes, set_threads.restype = [ctypes.POINTER(i)], i
    return lib


def available() -> bool:
    """Whether MKL's packed GEMM can be called in this process."""
    return _load() is not None


@functools.cache
def bf16_as_fp32() -> bool:
    """Whether bf16 weights are packed as fp32 for MKL here: without AMX, unless
    ``KVMEM_CPU_BF16_WEIGHTS=bf16`` keeps them bf16 (on oneDNN), and always where oneDNN
    cannot run bf16 GEMMs on this CPU."""
    if not onednn_gemm.available(torch.bfloat16):
        return True
    if os.environ.get("KVMEM_CPU_BF16_WEIGHTS", "fp32") == "bf16":
        return False
    return not cpu_features.amx()


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out_features, in_features]`` in MKL's packed (fp32) layout."""

    buffer: torch.Tensor  # uint8, as sized by cblas_sgemm_pack_get_size
    out_features: int
    in_features: int
    bf16: torch.Tensor | None = None  # the bf16 weight [out, in], for small batches

    @property
    def nbytes(self) -> int:
        """The bytes of the weight it stands for (what is resident, not the reservation)."""
        extra = 0 if self.bf16 is None else self.bf16.numel() * 2
        return self.out_features * self.in_features * 4 + extra


@functools.cache
def backend(dtype: torch.dtype) -> str:
    """``"onednn"`` or ``"mkl"``: which GEMM runs this process's CPU projections of
    ``dtype`` weights (``KVMEM_CPU_GEMM``, else timed once here)."""
    choice = os.environ.get("KVMEM_CPU_GEMM", "auto")
    if choice not in ("auto", "mkl", "onednn"):
        raise ConfigError(f"KVMEM_CPU_GEMM must be auto, mkl or onednn, not {choice!r}")
    if not onednn_gemm.available():
        return "mkl"
    if dtype == torch.bfloat16 and not onednn_gemm.available(dtype):
        # no bf16 GEMM on this CPU: the weights are widened and run as fp32 weights do
        # (the model logs it when it packs them)
        return backend(torch.float32)
    if choice == "onednn" or _load() is None or (dtype != torch.float32 and not bf16_as_fp32()):
        return "onednn"  # asked for, or MKL does not take these weights here
    if choice == "mkl":
        return "mkl"
    if not _intel_cpu():
        # MKL takes a generic path on other CPUs: oneDNN measured 1.1-2.4x faster on the
        # two AMD EPYCs tried, and there the timing sat near the margin on one of them and
        # flipped between processes
        log.info("CPU projections on oneDNN: MKL takes its generic path on CPUs not made "
                 "by Intel (KVMEM_CPU_GEMM=mkl overrides)")
        return "onednn"
    speedup = _onednn_speedup(dtype)
    picked = "onednn" if speedup >= ONEDNN_MARGIN else "mkl"
    log.info("%s CPU projections on %s: oneDNN's GEMM ran %.2fx MKL's packed fp32 here "
             "(KVMEM_CPU_GEMM=mkl|onednn overrides)", str(dtype).removeprefix("torch."),
             "oneDNN" if picked == "onednn" else "MKL", speedup)
    return picked


@functools.cache
def _intel_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU is Intel's (from Linux's cpuinfo; without it assumed so, which
    leaves the choice to the timing)."""
    try:
        info = cpuinfo.read_text()
    except OSError:
        return True
    vendors = {line.split(":", 1)[1].strip() for line in info.splitlines()
               if line.startswith("vendor_id")}
    return not vendors or vendors == {"GenuineIntel"}


def _onednn_speedup(dtype: torch.dtype) -> float:
    """Geometric mean over ``_PROBE_ROWS`` of MKL's time over oneDNN's (best of 3 each)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(*_PROBE_SHAPE, generator=gen) * 0.02).to(dtype)
    mkl, dnn = pack_mkl(weight), onednn_gemm.pack(weight)
    ratios = []
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, _PROBE_SHAPE[1], generator=gen).to(dtype)
        ratios.append(_best_time(x, mkl) / _best_time(x, dnn))
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def _best_time(x: torch.Tensor, weight: PackedWeight | OneDNNWeight, repeats: int = 3
               ) -> float:
    linear(x, weight)  # warm-up: first-call set-up is not what is being compared
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return best


def pack(weight: torch.Tensor) -> PackedWeight | OneDNNWeight | None:
    """``weight`` laid out once for ``x @ weight.T`` by the chosen backend (``backend``),
    or None where that does not apply."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0 \
            or weight.dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.enabled():
        return None
    if backend(weight.dtype) == "onednn":
        if not onednn_gemm.available(weight.dtype):
            weight = weight.float()  # bf16 values, exact in fp32, on oneDNN's fp32 GEMM
        return onednn_gemm.pack(weight)
    return pack_mkl(weight)


def pack_mkl(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` in MKL's packed fp32 layout (and its bf16 copy for small batches)."""
    api = _load()
    if api is None or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0:
        return None
    bf16 = None
    if weight.dtype == torch.bfloat16 and bf16_as_fp32():
        if bf16_kernel_available():
            bf16 = weight.detach().contiguous()  # its own tensor: the parameter is emptied
        weight = weight.float()
    if weight.dtype != torch.float32:
        return None
    n, k = weight.shape
    if weight.stride(1) == 1:  # row-major [n, k]: B = weight^T is a transposed operand
        trans, ld = _TRANS, weight.stride(0)
    elif weight.stride(0) == 1:  # column-major: weight^T is a row-major [k, n]
        trans, ld = _NO_TRANS, weight.stride(1)
    else:
        weight = weight.contiguous()
        trans, ld = _TRANS, k
    buffer = torch.empty(api.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS, n, k),
                         dtype=torch.uint8)
    api.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, trans, _PACK_ROWS, n, k, 1.0,
                         weight.data_ptr(), ld, buffer.data_ptr())
    return PackedWeight(buffer, n, k, bf16)


@functools.cache
def _bf16_kernel() -> ctypes._CFuncPtr | None:
    """``kvmem_gemm_bf16`` where the CPU has AVX-512 BF16 and the kernels build, else None."""
    library = cpu_kernels.library()
    if library is None or not cpu_features.avx512_bf16():
        return None
    probe = torch.ones(_BF16_ROW_GROUP, 2, dtype=torch.bfloat16)
    out = torch.empty(_BF16_ROW_GROUP, 1)
    fn = library.kvmem_gemm_bf16
    ok = fn(probe.data_ptr(), 2, _BF16_ROW_GROUP, 2, 1, probe.data_ptr(), out.data_ptr(), 1) == 0
    return fn if ok and bool((out == 2.0).all()) else None


def bf16_kernel_available() -> bool:
    """Whether small bf16 batches can run on the bf16 weights here (AVX-512 BF16)."""
    return _bf16_kernel() is not None


def _small_bf16(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` in fp32 for bf16 ``rows`` [m, k] (unit stride) and ``weight``."""
    m, k = rows.shape
    n = weight.shape[0]
    groups = -(-m // _BF16_ROW_GROUP) * _BF16_ROW_GROUP  # the kernel takes whole groups
    if groups != m:
        rows = torch.cat([rows, rows.new_zeros(groups - m, k)])
    out = torch.empty((groups, n), dtype=torch.float32)
    _bf16_kernel()(rows.data_ptr(), rows.stride(0), groups, k, n, weight.data_ptr(),
                   out.data_ptr(), n)
    return out[:m]


def linear(x: torch.Tensor, weight: PackedWeight | OneDNNWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for the packed ``W``: ``x`` ``[..., in_features]`` fp32, or
    bf16 (computed in fp32, returned in bf16)."""
    if isinstance(weight, OneDNNWeight):
        return onednn_gemm.linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        rows = x.reshape(-1, x.shape[-1])
        if weight.bf16 is not None and rows.shape[0] <= SMALL_BF16_ROWS \
                and rows.shape[-1] == weight.in_features and rows.stride(-1) == 1:
            y = _small_bf16(rows, weight.bf16)
            if bias is not None:
                y += bias
            return y.to(torch.bfloat16).view(*x.shape[:-1], weight.out_features)
        y = linear(x.float(), weight, None if bias is None else bias.float())
        return y.to(torch.bfloat16)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"a packed weight takes fp32 or bf16 CPU inputs, not {x.dtype} on "
                        f"{x.device.type}")
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight takes {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.stride(0) < k:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    if m:
        api = _load()
        threads = torch.get_num_threads()
        if getattr(_threads, "count", None) != threads:
            # MKL's default on a new thread is every core, whatever torch was told
            api.mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(threads)))
            _threads.count = threads
        api.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, rows.data_ptr(),
                                rows.stride(0), weight.buffer.data_ptr(), k, 0.0,
                                out.data_ptr(), n)
    if bias is not None:  # not through beta: MKL's one-row path drops C (measured)
        out += bias
    return out.view(*x.shape[:-1], n)
