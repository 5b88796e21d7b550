"""Elastic KV memory, worker side: vLLM's KV buffer over a reservation, mapped as decided.

- **Start-up.** vLLM allocates a worker's whole KV cache with one ``torch.zeros`` call
  inside the connector's ``get_mem_pool_context`` (vLLM's hook "to place the KV cache in
  a specific memory pool"). ``allocation_context`` answers that one call with a tensor of
  the same size over a reserved range (``kvmem.memory.backends``: an anonymous
  ``MAP_NORESERVE`` mapping on the CPU, CUDA virtual memory on a GPU) and maps only the
  granules of the null block; vLLM then views it per layer as always, so its kernels see
  ordinary tensors. Any other allocation in the context passes through; if vLLM makes no
  such call, start-up stops with one line.
- **Each step** (``apply``, from the connector's ``handle_preemptions``, which vLLM calls
  first thing in ``execute_model``, before it zeroes, copies or writes any block of the
  step) the step's mapping decisions are applied in order: block ranges mapped or
  unmapped (``layout`` turns them into granules). Messages are numbered; a
  missing one is an error.
- **A page that cannot be mapped** stops the engine at once with one line naming the
  rank and the blocks. With other ranks the worker's process exits (vLLM's executor sees
  it die, stops the other workers and fails the engine's requests; the other ranks are
  never left waiting in a collective for this one); a lone worker raises the error, and
  vLLM fails the step with it.

- **On the CPU** the reservation is a memory file (``kvmem.memory.shared_mmap``), which
  ``shared_file`` names for vLLM's connector handshake: the scheduler then releases the
  pages it gives back itself (``release``), and this worker's unmap of them frees nothing
  more.

Rank and world size come from vLLM's ``ParallelConfig`` (``rank``,
``tensor_parallel_size``, ``pipeline_parallel_size``). No wait between processes is
added here: the scheduler decides every page and the step message carries it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kvmem.cache.results import NULL_BLOCK_ID as NULL_BLOCK
from kvmem.errors import ConfigError, KvmemError
from kvmem.integrations.vllm.elastic.config import ElasticSettings
from kvmem.integrations.vllm.elastic.layout import GranuleMap, KVLayout
from kvmem.integrations.vllm.elastic.release import BlockRange, WorkerFile
from kvmem.memory.backends import BackendError, PageBackend, make_backend
from kvmem.memory.shared_mmap import SharedMmapBackend

log = logging.getLogger("vllm.kvmem.elastic")


class ElasticMapError(KvmemError):
    """A worker could not map the KV pages of a step."""


def rank_name(rank: int, tp: int, pp: int) -> str:
    return f"rank {rank} of {tp * pp} (pp stage {rank // tp}, tp rank {rank % tp})"


def _numel(args: tuple[Any, ...]) -> int | None:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
        else args
    if not all(isinstance(d, int) for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


class _TakeKVBuffer(TorchFunctionMode):
    """Answers vLLM's one ``torch.zeros(size, dtype=torch.int8)`` KV buffer allocation with
    the worker's reservation; every other call passes through."""

    def __init__(self, worker: ElasticWorker) -> None:
        super().__init__()
        self.worker = worker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.zeros and self.worker.buffer is None
                and kwargs.get("dtype") is torch.int8 and _numel(args) == self.worker.layout.size):
            return self.worker.reserve(torch.device(kwargs.get("device") or "cpu"))
        return func(*args, **kwargs)


class ElasticWorker:
    def __init__(self, *, layout: KVLayout, settings: ElasticSettings, rank: int,
                 tensor_parallel_size: int, pipeline_parallel_size: int,
                 has_peers: bool, backend: PageBackend | None = None) -> None:
        self.layout = layout
        self.settings = settings
        self.rank = rank
        self.name = rank_name(rank, tensor_parallel_size, pipeline_parallel_size)
        # With other ranks, a failed map ends this process (see the docstring).
        self.has_peers = has_peers
        self.pipeline_parallel_size = pipeline_parallel_size
        self.backend = backend
        self.reserved_bytes = 0
        self.buffer: torch.Tensor | None = None
        self.granules: GranuleMap | None = None
        self.mapped = np.zeros(layout.num_blocks, dtype=bool)
        self.seq = 0  # step messages applied
        self.maps = 0  # blocks mapped over the worker's life
        self.unmaps = 0  # and unmapped

    # -- start-up -------------------------------------------------------------------------
    @contextmanager
    def allocation_context(self) -> Iterator[None]:
        with _TakeKVBuffer(self):
            yield
        if self.buffer is None:
            raise ConfigError(
                f"kvmem elastic KV memory: {self.name}: vLLM allocated its KV cache without "
                f"a torch.zeros({self.layout.size}, dtype=torch.int8) call, so the KV cache "
                "cannot be placed over the reservation (unset KVMEM_VLLM_KV_MEMORY)")

    def reserve(self, device: torch.device) -> torch.Tensor:
        """The reservation as vLLM's KV buffer, with the null block mapped."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        backend = self.backend or make_backend(str(device), shared=True,
                                               huge_pages=bool(self.settings.huge_pages))
        g = backend.granularity
        size = -(-self.layout.size // g) * g
        try:
            backend.reserve(size)
            self.backend = backend
            self.granules = GranuleMap(backend, size)
            # Before anything else: the null block, which vLLM points every unused slot at.
            self.granules.map(self.layout.spans(NULL_BLOCK, NULL_BLOCK + 1))
        except (BackendError, OSError) as exc:
            raise ElasticMapError(f"kvmem: {self.name}: cannot reserve {size} bytes of KV "
                                  f"memory and map its null block: {exc}") from None
        self.mapped[NULL_BLOCK] = True
        self.reserved_bytes = size
        self.buffer = backend.tensor(0, self.layout.size).view(torch.int8)
        log.info("kvmem: %s: elastic KV memory: %d bytes reserved for %d blocks of %d bytes "
                 "(granules of %d bytes), %d mapped", self.name, size, self.layout.num_blocks,
                 self.layout.block_bytes, g, self.granules.mapped_bytes)
        return self.buffer

    def shared_file(self) -> WorkerFile | None:
        """The KV memory file, for the scheduler to release pages in (CPU, one pipeline
        stage: with several, vLLM keeps steps in flight while it schedules)."""
        b = self.backend
        if not isinstance(b, SharedMmapBackend) or b.fd is None or self.pipeline_parallel_size > 1:
            return None
        m = b.memory_file()
        return WorkerFile(rank=self.rank, pid=m.pid, fd=m.fd, size=self.reserved_bytes,
                          granularity=b.granularity, placements=tuple(self.layout.placements),
                          num_blocks=self.layout.num_blocks, kv_size=self.layout.size,
                          start_time=m.start_time, dev=m.dev, ino=m.ino)

    # -- each step ------------------------------------------------------------------------
    def apply(self, seq: int, ops: tuple[BlockRange, ...],
              expected_block_bytes: tuple[int, ...] | None = None) -> None:
        """Apply one step's mapping decisions, in order."""
        if self.granules is None:
            raise ElasticMapError(f"kvmem: {self.name}: a page map arrived before the KV "
                                  "cache was allocated")
        if seq != self.seq + 1:
            self._fail(f"expected page map message {self.seq + 1}, got {seq}")
        self.seq = seq
        if expected_block_bytes is not None:
            self._check_accounting(expected_block_bytes)
        for mapping, start, end in ops:
            if mapping:
                self._map(start, end)
            else:
                self._unmap(start, end)

    def _map(self, start: int, end: int) -> None:
        if self.mapped[start:end].any():
            self._fail(f"cannot map KV blocks {start}..{end - 1}: some are mapped already "
                       "(the ranks disagree about the page map)")
        s = self.settings
        try:
            if s.map_error_rank == self.rank and end > (s.map_error_block or 0):
                raise BackendError("injected map failure")
            self.granules.map(self.layout.spans(start, end))  # type: ignore[union-attr]
        except (BackendError, OSError) as exc:
            self._fail(f"cannot map KV blocks {start}..{end - 1}: {exc}")
        self.mapped[start:end] = True
        self.maps += end - start

    def _unmap(self, start: int, end: int) -> None:
        if not self.mapped[start:end].all():
            self._fail(f"cannot unmap KV blocks {start}..{end - 1}: some are not mapped "
                       "(the ranks disagree about the page map)")
        try:
            self.granules.unmap(self.layout.spans(start, end))  # type: ignore[union-attr]
        except (BackendError, OSError) as exc:
            self._fail(f"cannot unmap KV blocks {start}..{end - 1}: {exc}")
        self.mapped[start:end] = False
        self.unmaps += end - start

    def _check_accounting(self, expected: tuple[int, ...]) -> None:
        if self.rank < len(expected) and expected[self.rank] != self.layout.block_bytes:
            log.warning("kvmem: %s holds %d KV bytes per block, the ledger counts %d for it: "
                        "kvmem top and the limit are off by the difference", self.name,
                        self.layout.block_bytes, expected[self.rank])

    def _fail(self, what: str) -> None:
        message = f"kvmem: {self.name}: {what}; stopping the engine"
        log.error(message)
        if self.has_peers:
            # Now, without cleanup: the other ranks may already wait for this one in a
            # collective, and only vLLM's executor, seeing this process gone, ends them.
            for handler in logging.getLogger("vllm").handlers:
                handler.flush()
            os._exit(1)
        raise ElasticMapError(message)

    # -- observation ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        backend = self.backend
        resident = backend.resident_bytes() if hasattr(backend, "resident_bytes") else -1
        return {"rank": self.rank, "mapped_blocks": int(self.mapped.sum()),
                "mapped_bytes": self.granules.mapped_bytes if self.granules else 0,
                "resident_bytes": resident, "reserved_bytes": self.layout.size,
                "block_bytes": self.layout.block_bytes, "seq": self.seq, "maps": self.maps,
                "unmaps": self.unmaps}
