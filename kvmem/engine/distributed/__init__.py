"""Tensor and pipeline parallelism over torch.distributed, every rank sized by ``kvmem.plan``.

Rank 0 (the driver) runs the scheduler and the KV cache manager and is tp rank 0 of
stage 0; the other ranks are worker processes it spawns (or that ``torchrun`` starts).
Every rank, rank 0 included, is built by ``kvmem.engine.rank_builder.build_rank`` (the
code a world-size-1 engine runs) with this package's ``GroupPeers`` for the collectives,
and runs the same ``ModelRunner`` on the ``SchedulerOutput`` rank 0 broadcasts; this
package is the communication only.

Public API: ``ParallelConfig``, ``from_torchrun_env``, ``init_distributed``,
``start_parallel`` / ``ParallelDriver`` (the driver side),
``run_launched_worker`` (a torchrun rank > 0) and the errors ``ParallelError``,
``WorkerDiedError``, ``StartupError``. Submodules import torch; this package's
``__init__`` only re-exports lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ParallelConfig": "config", "from_torchrun_env": "config",
    "ParallelError": "errors", "WorkerDiedError": "errors", "StartupError": "errors",
    "init_distributed": "state", "destroy_distributed": "state",
    "start_parallel": "driver", "ParallelDriver": "driver",
    "run_worker": "worker", "run_launched_worker": "worker",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
