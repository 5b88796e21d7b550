"""The driver's view of every rank's KV cache, for CPU and disk offloading (``kvmem.tiers``).

A block id names the same block on every rank; its bytes are spread over the ranks
(each holds its stage's layers and its KV heads). With a local launch on CPU, every
worker's KV tensors live in shared memory and the driver maps them, so the tiers' block
copier sees one storage holding every rank's slot tensors: an offloaded block is one
host row with all ranks' parts, stored and loaded whole. ``kvmem.engine.offload_setup``
wires it into the engine.

Ordering needs nothing more: the driver sees a step's tokens only after every rank has
written that step's KV, and a request waits for its loads before its next step.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem.engine.offload_setup import attach_offload
from kvmem.errors import ConfigError

__all__ = ["SharedKVStorage", "attach_offload", "shared_kv_storage"]


class SharedKVStorage:
    """Every rank's slot tensors, in rank order, as one KVStorage (the driver's view)."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self._slots = slots
        self.num_slots = len(slots)
        self.num_blocks = int(slots[0].shape[0])

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self._slots[slot]


def shared_kv_storage(driver: Any) -> SharedKVStorage:
    """Every rank's KV as the driver maps it; a one-line error when the ranks do not share."""
    if driver.shared_slots is None and driver.ctx.config.kv_memory == "elastic":
        raise ConfigError("CPU/disk offload with tensor/pipeline parallelism needs "
                          "--kv-memory plain (elastic KV is private to each rank)")
    if driver.shared_slots is None:
        raise ConfigError("CPU/disk offload with tensor/pipeline parallelism needs every rank "
                          "on this machine's CPU, started by the engine (not torchrun), with "
                          "room in /dev/shm for the KV cache")
    return SharedKVStorage(driver.shared_slots)
