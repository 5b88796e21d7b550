"""Where evicted KV goes: CPU and disk tiers with asynchronous transfers.

Blocks leave the device pool when a request finishes or is preempted (and when a cached
block is about to be reused), land in host memory and on local disk, are found again by
their prefix hash, and are loaded back into newly allocated blocks before a request
computes. See ``docs/offload.md``. The package knows nothing about the engine: the
scheduler talks to ``OffloadConnector``, and ``kvmem.engine.offload_setup`` wires it in.

Exports are loaded lazily, so ``kvmem.tiers.config`` (budgets, used by ``kvmem plan`` and
``EngineConfig``) imports no torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "OffloadConfig": "config", "TierIdentity": "config", "tier_capacity": "config",
    "Faults": "faults", "BlockHolder": "manager", "OffloadManager": "manager",
    "OffloadConnector": "connector", "TierStats": "stats", "LoadHandle": "transfer",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
