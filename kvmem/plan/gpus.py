"""Common GPUs by name -> total device memory as the CUDA (or ROCm) runtime reports it.

These are the totals ``torch.cuda.mem_get_info()`` / ``cudaMemGetInfo`` return, a little
below the marketing size (the driver keeps some memory). Figures are GiB to two decimals,
as seen in public engine logs and out-of-memory messages; see docs/plan.md for sources and
confidence. Anything else: give the size with ``--gpu-memory GiB``.
"""

from __future__ import annotations

import difflib
import re

from kvmem.errors import ConfigError
from kvmem.units import GiB

# canonical name -> total GiB reported by the runtime
GPU_MEMORY_GIB: dict[str, float] = {
    "H100": 79.19,  # H100 80GB (SXM and PCIe)
    "H100-NVL": 93.10,
    "H200": 139.81,
    "B200": 178.36,
    "A100-80GB": 79.15,
    "A100-40GB": 39.50,
    "L40S": 44.42,
    "L40": 44.42,
    "L4": 22.05,
    "A10G": 22.20,
    "A10": 22.06,
    "RTX-4090": 23.65,
    "RTX-3090": 23.69,
    "RTX-A6000": 47.54,
    "V100-16GB": 15.77,
    "V100-32GB": 31.74,
    "T4": 14.75,
    "MI300X": 191.98,
}

_ALIASES = {
    "h100-80gb": "H100", "h100-sxm": "H100", "h100-pcie": "H100", "h100-sxm5": "H100",
    "h100nvl": "H100-NVL", "h200-141gb": "H200", "b200-192gb": "B200",
    "a100": "A100-80GB", "a100-80g": "A100-80GB", "a100-40g": "A100-40GB",
    "4090": "RTX-4090", "rtx4090": "RTX-4090", "3090": "RTX-3090", "rtx3090": "RTX-3090",
    "a6000": "RTX-A6000", "v100": "V100-32GB", "v100-16g": "V100-16GB", "v100-32g": "V100-32GB",
    "mi300": "MI300X",
}


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower().removeprefix("nvidia").strip(" -_"))


_INDEX = {_key(k): k for k in GPU_MEMORY_GIB} | {_key(k): v for k, v in _ALIASES.items()}


def canonical_gpu(name: str) -> str:
    """Resolve a GPU name or alias (case-insensitive) to its catalog name."""
    found = _INDEX.get(_key(name))
    if found is None:
        close = difflib.get_close_matches(_key(name), list(_INDEX), n=8, cutoff=0.6)
        names = list(dict.fromkeys(_INDEX[c] for c in close))[:3]  # aliases share a name
        hint = f"; did you mean {', '.join(names)}?" if names else ""
        raise ConfigError(f"unknown GPU {name!r}{hint} (known: {', '.join(GPU_MEMORY_GIB)}; "
                          "or give --gpu-memory GiB)")
    return found


# canonical name -> CUDA compute capability major (vLLM picks attention backends by it;
# kvmem.plan.vllm_backends); ROCm GPUs have none
GPU_ARCH: dict[str, int] = {
    "H100": 9, "H100-NVL": 9, "H200": 9, "B200": 10, "A100-80GB": 8, "A100-40GB": 8,
    "L40S": 8, "L40": 8, "L4": 8, "A10G": 8, "A10": 8, "RTX-4090": 8, "RTX-3090": 8,
    "RTX-A6000": 8, "V100-16GB": 7, "V100-32GB": 7, "T4": 7,
}


def gpu_arch(name: str) -> int | None:
    """The CUDA compute capability major of a catalog GPU (None: not an NVIDIA GPU)."""
    return GPU_ARCH.get(canonical_gpu(name))


def gpu_memory_bytes(name: str) -> int:
    """Total memory of a catalog GPU in bytes (rounded to the MiB)."""
    return round(GPU_MEMORY_GIB[canonical_gpu(name)] * 1024) * (GiB // 1024)
