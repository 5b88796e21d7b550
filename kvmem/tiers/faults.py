"""Injected faults, for tests and for exercising the failure paths on a real deployment.

Each fault reproduces a real failure through the same code path it would take: a slow
copy keeps source blocks held longer, a failed read raises the ``OSError`` a bad disk
would, a corrupted file is really corrupted on disk (and caught by its checksum), and a
full disk makes the write fail with ``ENOSPC``.
"""

from __future__ import annotations

import errno
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Faults:
    store_delay_s: float = 0.0  # sleep before each store copies its blocks out of the pool
    read_error_rate: float = 0.0  # fraction of block reads that fail with EIO
    corrupt_rate: float = 0.0  # fraction of written block files that get one byte flipped
    disk_full: bool = False  # every disk write fails with ENOSPC
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _chance(self, rate: float) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def before_store(self) -> None:
        if self.store_delay_s > 0:
            time.sleep(self.store_delay_s)

    def before_read(self) -> None:
        if self._chance(self.read_error_rate):
            raise OSError(errno.EIO, "injected read error")

    def before_write(self) -> None:
        if self.disk_full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def after_write(self, path: Path) -> None:
        if self._chance(self.corrupt_rate):
            with open(path, "r+b") as f:
                f.seek(-1, 2)
                last = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([last[0] ^ 0xFF]))


NO_FAULTS = Faults()
