"""The CPU tier: an arena of host rows, pinned when the KV pool is on CUDA.

The arena is allocated once (``budget // block_nbytes`` rows, ``host_rows.HostRows``), so
storing a block never allocates and the accounting is exact: ``used_bytes = blocks stored *
block_nbytes``. The transfer engine copies pool blocks straight into an entry's row
(``reserve``, then ``commit``) and loads a pinned entry straight from its row
(``in_place``), so a block crosses between device and host once each way.
A budget larger than the memory available at start-up is refused with a ``ConfigError``.
With a CPU pool the arena is ordinary pageable memory, and its untouched pages are not
backed by RAM until first written; with a CUDA pool it is pinned (page-locked), so the
whole budget is committed in RAM as soon as the tier starts.
"""

from __future__ import annotations

import torch

from kvmem.errors import ConfigError
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.host_rows import HostRows, RowRef
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
    in_place = True

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
            self.rows = HostRows(capacity_blocks, block_nbytes, pin_memory)
        except RuntimeError as e:  # out of (pinnable) host memory
            raise ConfigError(f"--cpu-offload-gib: cannot allocate "
                              f"{format_bytes(capacity_blocks * block_nbytes)} of "
                              f"{'pinned ' if pin_memory else ''}host memory "
                              f"({str(e).splitlines()[0]})") from None

    def ref(self, entry: Entry) -> RowRef:
        """Where ``entry``'s bytes are; read or write them there only while it is pinned
        (or reserved and not yet committed)."""
        return self.rows, entry.handle

    def _entry_bytes(self, name: str) -> int:
        return self.block_nbytes

    @property
    def entry_nbytes(self) -> int:
        return self.block_nbytes

    def _allocate(self, name: str) -> int:
        return self.rows.take(1)[0]  # _make_room made room

    def _write(self, entry: Entry, row: torch.Tensor) -> None:
        self.rows.row(entry.handle).copy_(row)

    def _read(self, entry: Entry, out: torch.Tensor) -> None:
        out.copy_(self.rows.row(entry.handle))

    def _release(self, entry: Entry) -> None:
        self.rows.give_back([entry.handle])
