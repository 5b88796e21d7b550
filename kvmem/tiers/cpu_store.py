"""The CPU tier: an arena of host rows, pinned when the KV pool is on CUDA.

The arena is allocated once (``budget // block_nbytes`` rows), so storing a block never
allocates and the accounting is exact: ``used_bytes = blocks stored * block_nbytes``.
Untouched arena pages are not backed by RAM until first written.
"""

from __future__ import annotations

import torch

from kvmem.errors import ConfigError
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.policy import LRUPolicy
from kvmem.tiers.store import BlockStore, Entry
from kvmem.units import format_bytes


class CPUStore(BlockStore):
    name = "cpu"

    def __init__(self, budget_bytes: int, block_nbytes: int, policy: LRUPolicy,
                 pin_memory: bool = False, faults: Faults = NO_FAULTS) -> None:
        capacity_blocks = budget_bytes // block_nbytes
        if capacity_blocks < 1:
            raise ConfigError(f"CPU offload budget {format_bytes(budget_bytes)} is smaller than "
                              f"one KV block ({format_bytes(block_nbytes)})")
        super().__init__(capacity_blocks * block_nbytes, policy, faults)
        self.block_nbytes = block_nbytes
        self._arena = torch.empty((capacity_blocks, block_nbytes), dtype=torch.uint8,
                                  pin_memory=pin_memory)
        self._free_rows = list(range(capacity_blocks - 1, -1, -1))

    def _entry_bytes(self, name: str) -> int:
        return self.block_nbytes

    def _allocate(self, name: str) -> int:
        return self._free_rows.pop()

    def _write(self, entry: Entry, row: torch.Tensor) -> None:
        self._arena[entry.handle].copy_(row)

    def _read(self, entry: Entry, out: torch.Tensor) -> None:
        out.copy_(self._arena[entry.handle])

    def _release(self, entry: Entry) -> None:
        self._free_rows.append(entry.handle)
