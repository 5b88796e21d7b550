"""Injected page-map failures, to drive the failure path of elastic KV memory on a real
device and in tests.

``KVMEM_FAULT_MAP="rank=1,after=3"`` makes that rank's page backend fail its fourth map
(and every later one) with the ``BackendError`` a driver refusal raises, e.g. the
``CUDA_ERROR_OUT_OF_MEMORY`` of ``cuMemCreate``. It is read where a rank builds its
elastic storage, so spawned ranks see it too. ``rank`` defaults to every rank.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvmem.errors import ConfigError
from kvmem.memory.backends import BackendError, PageBackend

if TYPE_CHECKING:
    import torch

ENV = "KVMEM_FAULT_MAP"


def map_fault_after(rank: int, environ: dict[str, str] | None = None) -> int | None:
    """How many maps ``rank`` may do before the injected failure (None: no fault)."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return None
    try:
        fields = dict(part.split("=", 1) for part in spec.split(","))
        after = int(fields.pop("after"))
        ranks = {int(fields.pop("rank"))} if "rank" in fields else None
    except (KeyError, ValueError):
        raise ConfigError(f"{ENV}={spec!r}: expected 'after=N' or 'rank=R,after=N'") from None
    if fields or after < 0:
        raise ConfigError(f"{ENV}={spec!r}: expected 'after=N' or 'rank=R,after=N'")
    return after if ranks is None or rank in ranks else None


class FailingMaps:
    """A backend whose maps fail after the first ``after``; everything else delegates."""

    def __init__(self, backend: PageBackend, after: int) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self.left = after

    def reserve(self, nbytes: int) -> None:
        self.backend.reserve(nbytes)

    def map(self, offset: int, length: int) -> None:
        if self.left <= 0:
            raise BackendError(f"mapping {length} bytes at {offset} failed "
                               f"(injected by {ENV})")
        self.left -= 1
        self.backend.map(offset, length)

    def unmap(self, offset: int, length: int) -> None:
        self.backend.unmap(offset, length)

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        return self.backend.tensor(offset, length)

    def close(self) -> None:
        self.backend.close()


def with_injected_faults(backend: PageBackend, rank: int) -> PageBackend:
    after = map_fault_after(rank)
    return backend if after is None else FailingMaps(backend, after)
