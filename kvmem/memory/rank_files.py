"""Rank 0 of a parallel CPU engine releases every rank's KV pages at once.

On the CPU the other ranks keep their pages in a memory file
(``shared_mmap.SharedMmapBackend``). At start-up each of them names its file and its
page layout to rank 0 (``RankFile``, through the page-map coordinator's store); rank 0
opens each file (``FileHoles``: that process's kvmem memory file only) and, whenever it
unmaps pages (trimming, or giving back to another engine), punches the same pages out
of every rank's file before the ledger is told. So what an engine gives back is free on
every rank at once, the ranks of an idle engine not woken; they still replay every
decision with their next step (unmapping a page already punched frees nothing more), so
their page maps stay rank 0's.

Safe for the same reason rank 0's own unmap is: a page is given back only when none of
its blocks is live, and no rank reads or writes a block that is not. On any failure
(a file that cannot be checked, opened or punched) it stops, with one line in the log,
and the ranks release with their next step, as on a GPU (no memory files there).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from kvmem.errors import KvmemError
from kvmem.memory.backends import BackendError
from kvmem.memory.shared_mmap import FileHoles, MemoryFile

log = logging.getLogger("kvmem.memory")


@dataclass(frozen=True)
class RankFile:
    """A rank's KV memory file and where each page lies in it (``PageGeometry``'s
    ``regions``: page ``p`` of slot ``s`` at ``s * slot_bytes + p * page_slot_bytes``)."""

    rank: int
    file: MemoryFile
    granularity: int
    num_slots: int
    slot_bytes: int
    page_slot_bytes: int

    def regions(self, first: int, pages: int) -> list[tuple[int, int]]:
        """(offset, length) of pages ``first`` to ``first + pages`` in each slot."""
        return [(s * self.slot_bytes + first * self.page_slot_bytes,
                 pages * self.page_slot_bytes) for s in range(self.num_slots)]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> RankFile:
        """A rank's description as it sent it; ``KvmemError`` if it is not one."""
        try:
            return cls(**{**doc, "file": MemoryFile(**doc["file"])})
        except (TypeError, KeyError) as e:
            raise KvmemError(f"not a KV memory file's description ({e})") from None


def runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """Consecutive pages as (first page, count), in order."""
    out: list[tuple[int, int]] = []
    for p in sorted(pages):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


class RankFiles:
    """The other ranks' KV memory files, opened by rank 0 (see the module docstring)."""

    def __init__(self) -> None:
        self._ranks: list[tuple[RankFile, FileHoles]] = []
        self.released_bytes = 0  # bytes punched out of the other ranks' files

    @property
    def active(self) -> bool:
        return bool(self._ranks)

    def connect(self, files: Sequence[RankFile]) -> bool:
        """Open every rank's file; whether they are all in use (else none is)."""
        try:
            for f in sorted(files, key=lambda f: f.rank):
                if f.num_slots * f.slot_bytes > f.file.size:
                    raise BackendError(f"rank {f.rank}'s pages do not fit its memory file")
                self._ranks.append((f, FileHoles(f.file, f.granularity)))
        except (BackendError, KvmemError, OSError, ValueError, TypeError) as e:
            self._stop(f"cannot open the other ranks' KV memory files ({e})")
            return False
        return self.active

    def release(self, pages: Iterable[int]) -> None:
        """Punch ``pages`` out of every rank's file."""
        if not self._ranks:
            return
        try:
            for first, count in runs(pages):
                for f, holes in self._ranks:
                    for offset, length in f.regions(first, count):
                        holes.unmap(offset, length)
                        self.released_bytes += length
        except (BackendError, OSError) as e:
            self._stop(f"cannot release KV pages in the other ranks' memory files ({e})")

    def _stop(self, why: str) -> None:
        log.warning("elastic KV memory: %s; the other ranks release pages given back with "
                    "their next step instead", why)
        self.close()

    def close(self) -> None:
        for _, holes in self._ranks:
            holes.close()
        self._ranks.clear()
