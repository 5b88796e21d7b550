"""The reference serving engine: models, loaders, attention, scheduling and the runner.

Submodules import torch; this package itself stays import-light and exposes the offline
API lazily: ``from kvmem.engine import LLM, SamplingParams``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LLM": "kvmem.engine.llm",
    "LLMEngine": "kvmem.engine.llm_engine",
    "EngineConfig": "kvmem.engine.config",
    "SamplingParams": "kvmem.engine.sampling_params",
    "RequestOutput": "kvmem.engine.outputs",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvmem.engine' has no attribute {name!r}")
