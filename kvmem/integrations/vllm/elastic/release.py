"""Releasing a vLLM engine's CPU KV pages from its scheduler, with no step of its workers.

On the CPU each worker's KV buffer lies in a memory file (``kvmem.memory.shared_mmap``).
Each worker names it in vLLM's KV connector handshake (``get_handshake_metadata``, which
the engine core gathers from every worker once the KV caches are allocated): its process,
the file's descriptor and its KV layout (``WorkerFile``). ``WorkerFiles`` opens every
worker's file and keeps one ``GranuleMap`` per worker that follows the same page
decisions the workers apply; an unmap decision punches the freed granules out of every
worker's file there and then, in the scheduler's process.

- **Why.** An idle engine that gives memory back then needs no step: vLLM's workers are
  not woken, and do not poll their message queues for a second afterwards on the cores
  the busy engine needs. And what the ledger says was given back is free at once.
- **When it is safe.** Only where no step is in flight while the scheduler decides:
  vLLM runs one step at a time unless it keeps a batch queue (pipeline parallelism,
  asynchronous scheduling), so the scheduler uses it only when vLLM's
  ``max_concurrent_batches`` is 1. A page is punched at the moment the page table gives
  it back, when no block on it is live.
- **The workers still apply every decision** with their next step (unmapping a page
  already punched frees nothing more), so their page maps stay the scheduler's.
- **Only the worker's own file.** A handshake names the worker's process with its start
  time and the file's device and inode; ``FileHoles`` opens nothing else (a stale
  handshake whose pid another process took, a file on disk, another program's memory
  file are refused).
- **On any failure** (a file that cannot be checked, opened or punched, a handshake that
  makes no sense) it stops and says so in one line; the decisions then reach the workers
  with a step, as without it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass

from kvmem.errors import KvmemError
from kvmem.integrations.vllm.elastic.layout import GranuleMap, KVLayout, TensorPlacement
from kvmem.memory.backends import BackendError
from kvmem.memory.shared_mmap import FileHoles, MemoryFile

log = logging.getLogger("vllm.kvmem.elastic")

BlockRange = tuple[bool, int, int]  # (map: True / unmap: False, first block, end block)
# what a forged or garbled handshake can raise on its way through the layout arithmetic
_REFUSALS = (BackendError, KvmemError, OSError, ValueError, TypeError, ArithmeticError,
             LookupError)


def _counts(*values: object) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


@dataclass(frozen=True)
class WorkerFile:
    """A worker's KV memory file, as it tells the scheduler."""

    rank: int
    pid: int
    fd: int
    size: int  # the file's bytes (the reservation)
    granularity: int
    placements: tuple[TensorPlacement, ...]
    num_blocks: int
    kv_size: int  # the KV buffer's bytes within it
    start_time: int  # the worker process's (``/proc/PID/stat`` field 22)
    dev: int  # the file's device and inode
    ino: int

    def layout(self) -> KVLayout:
        """Its KV layout; refused (``KvmemError``) unless every block of every tensor lies
        within the KV buffer, which lies within the file."""
        sane = (_counts(self.num_blocks, self.kv_size, self.size) and self.num_blocks > 0
                and 0 < self.kv_size <= self.size and self.placements
                and all(isinstance(p, TensorPlacement) and _counts(*astuple(p))
                        and p.block_stride > 0 and p.num_layers > 0 and p.block_extent > 0
                        and p.offset + (p.num_layers - 1) * p.layer_stride
                        + (self.num_blocks - 1) * p.block_stride + p.block_extent
                        <= self.kv_size for p in self.placements))
        if not sane:
            raise KvmemError(f"worker {self.rank}'s KV layout does not fit its memory file")
        return KVLayout(self.placements, self.num_blocks, self.kv_size)

    def memory_file(self) -> MemoryFile:
        return MemoryFile(self.pid, self.start_time, self.fd, self.size, self.dev, self.ino)


class WorkerFiles:
    """Every worker's KV memory file, released from the scheduler (see the module
    docstring); inactive until ``connect`` succeeds."""

    def __init__(self) -> None:
        self._workers: list[tuple[KVLayout, GranuleMap, FileHoles]] = []
        self.active = False
        self.released_bytes = 0  # bytes punched out of the workers' files

    def connect(self, files: Sequence[WorkerFile], mapped: Iterable[tuple[int, int]],
                null_block: int = 0) -> bool:
        """Open every worker's file and start from the scheduler's page map: the null
        block and the ``mapped`` block ranges. Whether it is in use."""
        ranges = [(null_block, null_block + 1), *mapped]
        try:
            for f in sorted(files, key=lambda f: f.rank):
                layout = f.layout()
                holes = FileHoles(f.memory_file(), f.granularity)
                granules = GranuleMap(holes, f.size)
                self._workers.append((layout, granules, holes))
                for start, end in ranges:
                    granules.map(layout.spans(start, end))
        except _REFUSALS as exc:
            self._stop(f"cannot open the workers' KV memory files ({exc})")
            return False
        self.active = bool(self._workers)
        return self.active

    def apply(self, ops: Sequence[BlockRange]) -> bool:
        """Follow one batch of page decisions, in order, releasing what is unmapped;
        whether they were all applied (else the workers must apply them with a step)."""
        if not self.active:
            return False
        try:
            for mapping, start, end in ops:
                for layout, granules, _ in self._workers:
                    spans = layout.spans(start, end)
                    if mapping:
                        granules.map(spans)
                    else:
                        self.released_bytes += granules.unmap(spans)
        except _REFUSALS as exc:
            self._stop(f"cannot release KV pages in the workers' memory files ({exc})")
            return False
        return True

    def _stop(self, why: str) -> None:
        log.warning("kvmem: elastic KV memory: %s; pages given back reach the workers with "
                    "a step instead", why)
        self.close()

    def close(self) -> None:
        for _, _, holes in self._workers:
            holes.close()
        self._workers.clear()
        self.active = False
