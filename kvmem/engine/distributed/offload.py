"""The driver's view of every rank's KV cache, for CPU and disk offloading (``kvmem.tiers``).

A block id names the same block on every rank; its bytes are spread over the ranks
(each holds its stage's layers and its KV heads). An offloaded block is one host row on
the driver with every rank's part, in rank order, stored and loaded whole. The driver
reaches the other ranks' parts one of two ways:

- shared memory (local launch on CPU with plain KV, the default there): every worker's
  KV tensors live in /dev/shm and the driver maps them, so the tiers' block copier sees
  one storage holding every rank's slot tensors (``SharedKVStorage``);
- copy services (GPUs, torchrun, elastic KV): each worker runs a thread that sends and
  receives its part over gloo groups of their own (``remote_copy.RemoteKVStorage``).
  The workers must know at start, so offloading is configured on the engine
  (``EngineConfig.cpu_offload_gib`` / ``disk_offload_gib``), not attached later.

``kvmem.engine.offload_setup`` builds the tiers over either. Ordering needs nothing
more: the driver sees a step's tokens only after every rank has written that step's KV,
and a request waits for its loads (on every rank) before its next step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmem.engine.distributed.remote_copy import RemoteKVStorage
from kvmem.errors import ConfigError

if TYPE_CHECKING:
    from kvmem.engine.distributed.driver import ParallelDriver

__all__ = ["SharedKVStorage", "parallel_kv_storage", "shared_kv_storage"]


class SharedKVStorage:
    """Every rank's slot tensors, in rank order, as one KVStorage (the driver's view)."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self._slots = slots
        self.num_slots = len(slots)
        self.num_blocks = int(slots[0].shape[0])

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self._slots[slot]


def shared_kv_storage(driver: ParallelDriver) -> SharedKVStorage:
    """Every rank's KV as the driver maps it; a one-line error when the ranks do not share."""
    if driver.shared_slots is None:
        raise ConfigError("the workers' KV cache is not in shared memory (not every rank is "
                          "a local CPU process with --kv-memory plain, or /dev/shm is too "
                          "small)")
    return SharedKVStorage(driver.shared_slots)


def parallel_kv_storage(driver: ParallelDriver) -> SharedKVStorage | RemoteKVStorage:
    """The storage the offload tiers copy every rank's blocks through: shared memory when
    the workers share their KV, else their copy services."""
    if driver.shared_slots is not None:
        return SharedKVStorage(driver.shared_slots)
    copier = driver.remote_copier
    if copier is not None:
        return RemoteKVStorage(copier, copier.channel.num_slots)
    if driver.ctx.share_kv:
        raise ConfigError("CPU/disk offload with tensor/pipeline parallelism: the workers "
                          "could not put their KV cache in shared memory (/dev/shm too small?)")
    raise ConfigError("CPU/disk offload with tensor/pipeline parallelism is set up when the "
                      "workers start: give --cpu-offload-gib or --disk-offload-gib (the "
                      "EngineConfig fields)")
