"""The CPU tier: an arena of host rows, pinned when the KV pool is on CUDA.

The arena is allocated once (``budget // block_nbytes`` rows), so storing a block never
allocates and the accounting is exact: ``used_bytes = blocks stored * block_nbytes``.
A budget larger than the memory available at start-up is refused with a ``ConfigError``.
With a CPU pool the arena is ordinary pageable memory, and its untouched pages are not
backed by RAM until first written; with a CUDA pool it is pinned (page-locked), so the
whole budget is committed in RAM as soon as the tier starts.
"""

from __future__ import annotations

import torch

from kvmem.errors import ConfigError
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.policy import LRUPolicy
from kvmem.tiers.store import BlockStore, Entry, IndexListener
from kvmem.units import GiB, format_bytes


def check_host_memory(budget_bytes: int, setting: str = "--cpu-offload-gib") -> None:
    """Refuse a CPU tier larger than the memory this machine has available now; the error
    names the budget's ``setting`` (a flag, a config key)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is an engine dependency
        return
    available = psutil.virtual_memory().available
    if budget_bytes > available:
        raise ConfigError(f"{setting} {budget_bytes / GiB:g} exceeds the "
                          f"{format_bytes(available)} of memory available on this machine")


class CPUStore(BlockStore):
    name = "cpu"

    def __init__(self, budget_bytes: int, block_nbytes: int, policy: LRUPolicy,
                 pin_memory: bool = False, faults: Faults = NO_FAULTS,
                 on_change: IndexListener | None = None,
                 setting: str = "--cpu-offload-gib") -> None:
        """``setting``: how errors name the budget's setting (a flag, a config key)."""
        capacity_blocks = budget_bytes // block_nbytes
        if capacity_blocks < 1:
            raise ConfigError(f"{setting}: the CPU offload budget {format_bytes(budget_bytes)} "
                              f"is smaller than one KV block ({format_bytes(block_nbytes)})")
        check_host_memory(budget_bytes, setting)
        super().__init__(capacity_blocks * block_nbytes, policy, faults, on_change)
        self.block_nbytes = block_nbytes
        try:
            self._arena = torch.empty((capacity_blocks, block_nbytes), dtype=torch.uint8,
                                      pin_memory=pin_memory)
        except RuntimeError as e:  # out of (pinnable) host memory
            raise ConfigError(f"--cpu-offload-gib: cannot allocate "
                              f"{format_bytes(capacity_blocks * block_nbytes)} of "
                              f"{'pinned ' if pin_memory else ''}host memory "
                              f"({str(e).splitlines()[0]})") from None
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
