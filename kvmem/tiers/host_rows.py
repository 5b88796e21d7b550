"""Host memory for blocks, allocated once: an arena of block-sized rows.

Pinning host memory (``cudaHostAlloc``) costs far more than the copy it serves, so the
tiers pin once, at start-up: the CPU tier's arena, and the staging rows that carry
blocks the CPU tier does not hold to and from the disk. Rows are handed out lowest index
first, so the rows of one job mostly follow each other and a copy moves them as a few
long runs (``runs``) instead of one block at a time.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

import torch

# (arena, row index): where one block's bytes are in host memory
RowRef = tuple["HostRows", int]


class HostRows:
    """``num_rows`` rows of ``row_nbytes`` bytes, pinned when ``pin`` (a CUDA pool);
    ``take``/``give_back`` are thread-safe."""

    def __init__(self, num_rows: int, row_nbytes: int, pin: bool = False) -> None:
        self.tensor = torch.empty((num_rows, row_nbytes), dtype=torch.uint8, pin_memory=pin)
        self._free = list(range(num_rows))  # a heap: lowest rows first
        self._cv = threading.Condition()

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int, timeout: float = 0.0) -> list[int]:
        """Up to ``n`` free rows, lowest first; waits up to ``timeout`` s for at least one
        when none is free (none: an empty list)."""
        with self._cv:
            if not self._free and timeout > 0:
                self._cv.wait_for(lambda: self._free, timeout)
            return [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]

    def give_back(self, rows: Sequence[int]) -> None:
        with self._cv:
            for row in rows:
                heapq.heappush(self._free, row)
            self._cv.notify_all()

    def row(self, index: int) -> torch.Tensor:
        return self.tensor[index]


def runs(refs: Sequence[RowRef]) -> list[torch.Tensor]:
    """The rows of ``refs``, in order, as few views as possible: each view covers
    consecutive rows of one arena."""
    views: list[torch.Tensor] = []
    start = 0
    for i in range(1, len(refs) + 1):
        if i == len(refs) or refs[i][0] is not refs[i - 1][0] or refs[i][1] != refs[i - 1][1] + 1:
            arena, first = refs[start]
            views.append(arena.tensor[first:first + i - start])
            start = i
    return views
