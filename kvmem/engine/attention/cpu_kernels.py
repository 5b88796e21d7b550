"""CPU kernels: a small C library built at first use, called through ctypes.

Decode rows read their keys and values straight from the block-major cache, once, where
the SDPA path first gathers every block into a contiguous copy (on CPU decode is bound by
memory traffic, and the copy triples it). The library also holds the cache store
(``cache_ops.c``, ``store_kv``) and the decoder layer's fused elementwise steps
(``models/fused_ops.c`` and ``models/activation.c``, used by ``models/cpu_ops.py``). Its
sources are compiled with the system C compiler (``$CC``, else ``cc``) into
``$KVMEM_CACHE_DIR/kernels`` (default ``~/.cache/kvmem/kernels``), keyed by the sources,
flags and CPU, so a later start loads it in milliseconds. Without a compiler, or with
``KVMEM_CPU_KERNELS=0``, ``supports()`` is False and callers keep their torch paths.

The library is built for the CPU it runs on (``-march=native``, or x86-64-v3 with
``KVMEM_CPU_ISA=avx2``: ``kvmem.engine.cpu_features``), and each kernel's fast path is
compiled only where that target has its instructions: the prefill kernel and the bf16 GEMM
need AVX-512 (BF16), and say so (``kvmem_prefill_supported``, a failing probe), so their
callers fall back to SDPA and MKL; the decode kernel, the cache store and the fused ops
have a portable path that any x86-64 CPU runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvmem.engine import cpu_features

logger = logging.getLogger(__name__)

_COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC"]  # and -march=, from cpu_features
# each source with its own flags. paged_decode: -ffast-math lets the softmax's expf
# vectorise (glibc's libmvec); the kernel keeps no infinities or NaNs of its own (the running
# max starts at -FLT_MAX); activation: the same, for SiLU (its inputs are clamped), but
# with real divisions: -ffast-math's reciprocal-and-refine is 2 ulp off on AVX2 (silu(200)
# came out 199.99998), and the division costs nothing measurable in this memory-bound loop.
# fused_ops: the rotary arithmetic must round as the eager path does (no FMA contraction);
# reassociation only vectorises the RMSNorm sum
_MODELS = Path(__file__).parent.parent / "models"
_SOURCES = {
    Path(__file__).with_name("paged_decode.c"): ["-ffast-math"],
    _MODELS / "activation.c": ["-ffast-math", "-mrecip=!vec-div"],
    _MODELS / "fused_ops.c": [
        "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
        "-ffp-contract=off"],
    Path(__file__).with_name("cache_ops.c"): [],  # plain copies
    Path(__file__).with_name("prefill.c"): [],
    _MODELS / "bf16_gemm.c": [],
}
_HEADERS = [Path(__file__).with_name(name) for name in ("sum16.h", "aligned.h", "exp2.h")] \
    + [_MODELS / "bf16.h"]
_ARG_TYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
              ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
              ctypes.c_int, ctypes.c_int]
_CACHE_DTYPES = {torch.float32: "kvmem_paged_decode_f32",
                 torch.bfloat16: "kvmem_paged_decode_bf16"}

_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("KVMEM_CACHE_DIR") or Path.home() / ".cache" / "kvmem"
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU model and its flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [x for x in info.splitlines() if x.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _common_flags() -> list[str]:
    return [*_COMMON_FLAGS, f"-march={cpu_features.march()}"]


def _target(compiler: str) -> Path:
    """Where the library for these sources, flags, compiler and CPU is cached."""
    key = hashlib.sha256(compiler.encode() + " ".join(_common_flags()).encode()
                         + _cpu_id().encode())
    for source, flags in _SOURCES.items():
        key.update(source.read_bytes() + " ".join(flags).encode())
    for header in _HEADERS:
        key.update(header.read_bytes())
    return _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def needs_build() -> bool:
    """Whether the first use will compile the library (a compiler, and none cached yet)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    return enabled() and compiler is not None and not _target(compiler).exists()


def _build(compiler: str) -> Path:
    target = _target(compiler)
    if target.exists():
        return target
    common = _common_flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent first starts never load half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for source, flags in _SOURCES.items():
            obj = Path(tmp) / f"{source.stem}.o"
            subprocess.run([compiler, *common, *flags, "-c", str(source), "-o", str(obj)],
                           check=True, capture_output=True, timeout=120)
            objects.append(str(obj))
        built = Path(tmp) / target.name
        subprocess.run([compiler, *common, "-shared", *objects, "-o", str(built), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def enabled() -> bool:
    """False when ``KVMEM_CPU_KERNELS=0`` turns kvmem's CPU fast paths off (these kernels
    and the packed GEMM weights of ``kvmem.engine.models.packed_gemm``)."""
    return os.environ.get("KVMEM_CPU_KERNELS", "1") != "0"


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if not enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler: CPU decode attention gathers blocks for SDPA")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("CPU paged attention kernel not built (%s%s); using SDPA", e,
                       f": {detail.decode(errors='replace')[:200]}" if detail else "")
        return None
    for name in _CACHE_DTYPES.values():
        fn = getattr(library, name)
        fn.argtypes = _ARG_TYPES
        fn.restype = ctypes.c_int
    library.kvmem_paged_decode_limits.argtypes = [ctypes.c_int] * 3
    library.kvmem_paged_decode_limits.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for dtype in ("f32", "bf16"):
        fused = {f"kvmem_add_rms_norm_{dtype}": [ptr, ptr, ptr, ptr, ptr, i64, i64, i64,
                                                 ctypes.c_float, ctypes.c_int],
                 f"kvmem_rotary_{dtype}": [ptr, i64, i64, ctypes.c_int, ctypes.c_int, ptr, ptr,
                                           ctypes.c_int],
                 f"kvmem_silu_mul_{dtype}": [ptr, i64, i64, i64, ptr, ctypes.c_int]}
        for name, argtypes in fused.items():
            fn = getattr(library, name)
            fn.argtypes, fn.restype = argtypes, None
    library.kvmem_store_kv.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr] + [i64] * 6
    library.kvmem_store_kv.restype = i64
    library.kvmem_gemm_bf16.argtypes = [ptr, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ptr, ptr, i64]
    library.kvmem_gemm_bf16.restype = ctypes.c_int
    library.kvmem_prefill_supported.argtypes = [ctypes.c_int, ctypes.c_int]
    library.kvmem_prefill_supported.restype = ctypes.c_int
    library.kvmem_prefill_attention.argtypes = [
        ptr, i64, ptr, i64, i64, i64, ctypes.c_int, ptr, i64, ptr, ptr, ptr, ctypes.c_int, ptr,
        i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, i64, ctypes.c_int,
        ctypes.c_int]
    library.kvmem_prefill_attention.restype = ctypes.c_int
    _library = library
    return library


def available() -> bool:
    """Whether the library is built and loaded (builds it on the first call)."""
    return _load() is not None


def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (builds it on the first call)."""
    return _load()


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode`` runs for this query and cache (CPU, a layout it handles,
    and the kernel built)."""
    if q.device.type != "cpu" or kv_cache.dtype not in _CACHE_DTYPES or kv_cache.dim() != 5:
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, two, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if two != 2 or cache_dim != head_dim or num_heads % num_kv_heads \
            or not kv_cache.is_contiguous():
        return False
    library = _load()
    return library is not None and bool(library.kvmem_paged_decode_limits(
        num_heads // num_kv_heads, head_dim, block_size))


def paged_decode(q: torch.Tensor, rows: torch.Tensor | None, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (``supports`` first).

    ``q`` ``[T, Hq, D]``; sequence b's query is row ``rows[b]`` (int64), or row b when
    ``rows`` is None; ``block_table`` int32 ``[B, max_blocks]``; ``seq_lens`` int32 ``[B]``
    (the new token included, already written to the cache). Returns ``[B, Hq, D]``.
    """
    library = _load()
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    query = q.float()
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    index = rows.contiguous() if rows is not None else None
    num_seqs = lens.shape[0]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=torch.float32)
    status = getattr(library, _CACHE_DTYPES[kv_cache.dtype])(
        kv_cache.data_ptr(), query.data_ptr(), query.stride(0),
        index.data_ptr() if index is not None else None, out.data_ptr(), out.stride(0),
        table.data_ptr(), table.stride(0), lens.data_ptr(), num_seqs, num_heads,
        num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
        torch.get_num_threads())
    if status:
        raise MemoryError("CPU paged decode attention could not allocate its scratch memory")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


_PREFILL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, starts: torch.Tensor,
                  q_lens: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                  scale: float, sliding_window: int | None) -> torch.Tensor | None:
    """Causal attention of prefill chunks over their cached context and themselves.

    Chunk c is token rows ``starts[c]:starts[c] + q_lens[c]`` of ``q`` ``[T, Hq, D]``, the
    last ``q_lens[c]`` of its sequence's ``seq_lens[c]`` tokens, whose keys and values
    (these rows' included) are in ``kv_cache`` ``[blocks, 2, block_size, Hkv, D]`` at the
    blocks of ``block_table[c]`` (int64 vectors, an int32 table). Returns fp32 ``[T, Hq, D]``
    with the chunks' rows filled (``prefill.c``), or None where the kernel does not apply
    (another device, a dtype other than the cache's fp32 or bf16, no library).
    """
    dtype = _PREFILL_DTYPES.get(q.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    if dtype is None or q.device.type != "cpu" or kv_cache.dtype != q.dtype \
            or kv_cache.dim() != 5 or kv_cache.shape[4] != head_dim \
            or num_heads % kv_cache.shape[3] or not kv_cache.is_contiguous():
        return None
    library = _load()
    num_kv_heads = kv_cache.shape[3]
    if library is None or not library.kvmem_prefill_supported(head_dim,
                                                              num_heads // num_kv_heads):
        return None
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    bounds = [t.to(torch.int64).contiguous() for t in (starts, q_lens, seq_lens)]
    table = block_table.to(torch.int32).contiguous()
    status = library.kvmem_prefill_attention(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.shape[2], table.data_ptr(),
        table.stride(0), *(b.data_ptr() for b in bounds), len(bounds[0]), out.data_ptr(),
        out.stride(0), num_heads, num_kv_heads, head_dim, scale * math.log2(math.e),
        sliding_window or 0, dtype, torch.get_num_threads())
    if status == 1:
        raise MemoryError("CPU prefill attention could not allocate its scratch memory")
    return out if status == 0 else None


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Copy each token's k/v ``[T, Hkv, D]`` rows to its slot of ``kv_cache``
    ``[num_blocks, 2, block_size, Hkv, D]`` (slot -1: skipped). False, with nothing written,
    where the kernel does not apply (another device or dtype, rows that are not contiguous
    ``[Hkv, D]``, no library); an out-of-range slot is an ``IndexError``."""
    if kv_cache.device.type != "cpu" or not k.dtype == v.dtype == kv_cache.dtype \
            or kv_cache.dim() != 5 or k.dim() != 3 or v.shape != k.shape \
            or k.shape[1:] != kv_cache.shape[3:] or slot_mapping.dtype != torch.int64:
        return False
    heads, dim = k.shape[1], k.shape[2]
    if any(t.stride(2) != 1 or t.stride(1) != dim for t in (k, v)) \
            or kv_cache.stride(3) != dim or kv_cache.stride(4) != 1:
        return False
    library = _load()
    if library is None:
        return False
    slots = slot_mapping.contiguous()
    size = kv_cache.element_size()
    bad = library.kvmem_store_kv(
        k.data_ptr(), v.data_ptr(), k.stride(0) * size, v.stride(0) * size, slots.data_ptr(),
        slots.shape[0], kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0) * size,
        kv_cache.stride(1) * size, kv_cache.stride(2) * size, kv_cache.shape[2],
        heads * dim * size)
    if bad:
        raise IndexError(f"slot {int(slots[bad - 1])} is past the cache's "
                         f"{kv_cache.shape[0]} blocks of {kv_cache.shape[2]}")
    return True
