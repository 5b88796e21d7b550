"""CPU and disk offloading for a parallel engine's KV cache (``kvmem.tiers``).

A block id names the same block on every rank; its bytes are spread over the ranks
(each holds its stage's layers and its KV heads). With a local launch on CPU, every
worker's KV tensors live in shared memory and the driver maps them, so the tiers' block
copier sees one storage holding every rank's slot tensors: an offloaded block is one
host row with all ranks' parts, stored and loaded whole.

Ordering needs nothing more: the driver sees a step's tokens only after every rank has
written that step's KV, and a request waits for its loads before its next step.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem.errors import ConfigError
from kvmem.tiers import OffloadConfig
from kvmem.tiers.connector import OffloadConnector
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.manager import OffloadManager


class SharedKVStorage:
    """Every rank's slot tensors, in rank order, as one KVStorage (the driver's view)."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self._slots = slots
        self.num_slots = len(slots)
        self.num_blocks = int(slots[0].shape[0])

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self._slots[slot]


def attach_offload(engine: Any, config: OffloadConfig,
                   faults: Faults = NO_FAULTS) -> OffloadConnector:
    """``kvmem.tiers.integration.attach_offload`` for an engine with parallel ranks."""
    from kvmem.engine.scheduler import Scheduler
    from kvmem.tiers.integration import _offload_scheduler_class, engine_identity

    driver = engine.parallel
    if driver is None:
        raise ConfigError("this engine has no parallel ranks; use kvmem.tiers.attach_offload")
    if driver.shared_slots is None:
        raise ConfigError("CPU offload with tensor/pipeline parallelism needs every rank on "
                          "this machine's CPU, started by the engine (not torchrun), with "
                          "room in /dev/shm for the KV cache")
    storage = SharedKVStorage(driver.shared_slots)
    model, _ = engine_identity(engine)
    p = driver.parallel
    stages = driver.state.allocations[::p.tensor_parallel_size]
    groups = ";".join(f"{g.kind.value}:{g.window}:{','.join(map(str, g.layers))}"
                      for g in engine.spec.kv_groups())
    layout = (f"tp={p.tensor_parallel_size} pp={p.pipeline_parallel_size} "
              f"partition={','.join(str(len(a.layers)) for a in stages)} ranks=all "
              f"groups={groups}")
    manager = OffloadManager(config, storage, storage.num_slots, engine.kv_cache_manager,
                             model=model, layout=layout, faults=faults)
    connector = OffloadConnector(manager, engine.kv_cache_manager)
    engine.scheduler = _offload_scheduler_class(Scheduler)(engine.scheduler, connector)
    engine.offload = connector
    return connector
