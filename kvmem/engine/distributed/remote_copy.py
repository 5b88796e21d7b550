"""Copying offloaded KV blocks to and from ranks whose KV cache the driver cannot map.

The tiers live on the driver (rank 0): a host row holds one block of every rank, the
ranks' parts one after another in rank order, each part that rank's slot rows
(``kvmem.tiers.blocks``). When the workers' KV tensors are not in shared memory (GPUs, a
torchrun launch, elastic KV), ``RemoteBlockCopier`` gives the tiers the same copier
interface: it copies the driver's own part locally and asks every worker's
``CopyService`` thread for the rest, over two gloo groups of their own so that copies
never interleave with the step broadcasts:

- ``commands``: a pickled ``(op, block ids, page batch number, page ops)`` from rank 0;
  a worker waits here between copies, so its bound is long (``IDLE_TIMEOUT``);
- ``data``: each worker's part of the rows (CPU ``uint8`` tensors, point to point since
  the parts differ in size) and the acknowledgement of a load, bounded by the step
  timeout, so a dead peer fails the copy (a skipped store, or a load recomputed); after
  a failed copy the ranks may be out of step, so the driver runs no more copies (every
  later store is skipped and every load recomputes).

A load returns only once every rank holds its bytes, so no step reads them before. With
elastic KV a load also carries rank 0's page mapping decisions not yet sent, which the
worker replays in order before writing (``kvmem.engine.distributed.page_ops``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvmem.engine.distributed.errors import ParallelError
from kvmem.engine.distributed.state import IDLE_TIMEOUT, DistributedGroups
from kvmem.tiers.blocks import BlockCopier

logger = logging.getLogger("kvmem.engine.distributed")

OP_STOP, OP_GATHER, OP_SCATTER = 0, 1, 2


@dataclass
class CopyChannel:
    """The copy groups and what every rank's part of a block is."""

    commands: dist.ProcessGroup
    data: dist.ProcessGroup
    part_nbytes: list[int]  # one block's bytes on each rank, rank order
    num_slots: int  # every rank's slots together


def open_copy_channel(groups: DistributedGroups, local: BlockCopier) -> CopyChannel:
    """Create the copy groups and exchange part sizes (collective: every rank calls it)."""
    parallel = groups.parallel
    everyone = list(range(parallel.world_size))
    commands = dist.new_group(everyone, timeout=IDLE_TIMEOUT, backend="gloo")
    data = dist.new_group(everyone, timeout=timedelta(seconds=parallel.timeout_s),
                          backend="gloo")
    parts: list[Any] = [None] * parallel.world_size
    dist.all_gather_object(parts, (local.block_nbytes, len(local.slots)), group=groups.startup)
    return CopyChannel(commands, data, [p[0] for p in parts], sum(p[1] for p in parts))


class RemoteKVStorage:
    """Every rank's KV as the driver's tiers see it; copies go through ``copier``."""

    def __init__(self, copier: RemoteBlockCopier, num_slots: int) -> None:
        self.copier = copier
        self.num_slots = num_slots

    def slot_tensor(self, slot: int) -> torch.Tensor:
        if slot >= len(self.copier.slots):
            raise IndexError(f"slot {slot} is on another rank: copy through block_copier()")
        return self.copier.slots[slot]

    def block_copier(self, num_slots: int) -> RemoteBlockCopier:
        """The copier ``kvmem.tiers.blocks.BlockCopier`` hands out for this storage."""
        if num_slots != self.num_slots:
            raise ValueError(f"{num_slots} slots asked, every rank holds {self.num_slots}")
        return self.copier


class RemoteBlockCopier:
    """A ``BlockCopier`` over every rank's KV: the driver's part here, the rest remote."""

    def __init__(self, local: BlockCopier, channel: CopyChannel, page_feed: Any = None) -> None:
        self.local = local
        self.channel = channel
        self.page_feed = page_feed  # a PageOpsFeed with elastic KV
        self.slots = local.slots
        self.device, self.on_cuda = local.device, local.on_cuda
        self.block_nbytes = sum(channel.part_nbytes)
        self._offsets = [sum(channel.part_nbytes[:r]) for r in range(len(channel.part_nbytes))]
        self._lock = threading.Lock()  # one copy at a time: the workers serve in order
        self._closed: str | None = None  # why no more copies run
        self._stopped = False  # the stop command was sent

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One copy at a time; after a failed one the ranks may be out of step (a late
        part would pass for the next copy's), so every later copy fails too."""
        with self._lock:
            if self._closed is not None:
                raise ParallelError(f"offload copies are off: {self._closed}")
            try:
                yield
            except Exception as e:
                self._closed = f"a copy failed ({str(e).splitlines()[0] if str(e) else e!r})"
                raise

    def compute_done_event(self) -> torch.cuda.Event | None:
        return self.local.compute_done_event()

    def _workers(self) -> list[tuple[int, int, int]]:
        """(rank, offset, nbytes) of every worker's part of a host row."""
        parts = self.channel.part_nbytes
        return [(r, self._offsets[r], parts[r]) for r in range(1, len(parts))]

    def _command(self, op: int, ids: list[int], seq: int = 0, ops: list | None = None) -> None:
        for rank, _, _ in self._workers():
            dist.send_object_list([(op, ids, seq, ops or [])], dst=rank,
                                  group=self.channel.commands)

    def gather(self, block_ids: Sequence[int], outs: Sequence[torch.Tensor],
               after: torch.cuda.Event | None = None) -> None:
        """Every rank's part of the blocks into the host rows ``outs`` (runs of rows taking
        the blocks in order); returns when all are there."""
        ids = [int(b) for b in block_ids]
        with self._exclusive():
            self._command(OP_GATHER, ids)
            rows = torch.empty((len(ids), self.block_nbytes), dtype=torch.uint8)
            own = torch.empty((len(ids), self.channel.part_nbytes[0]), dtype=torch.uint8)
            self.local.gather(ids, [own], after)
            rows[:, :self.channel.part_nbytes[0]].copy_(own)
            for rank, offset, nbytes in self._workers():
                part = torch.empty((len(ids), nbytes), dtype=torch.uint8)
                dist.recv(part, src=rank, group=self.channel.data)
                rows[:, offset:offset + nbytes].copy_(part)
            offset = 0
            for out in outs:
                out.copy_(rows[offset:offset + len(out)])
                offset += len(out)

    def scatter(self, block_ids: Sequence[int], srcs: Sequence[torch.Tensor]) -> None:
        """Host rows (runs of rows giving the blocks in order) into every rank's blocks;
        returns once every rank holds them."""
        ids = [int(b) for b in block_ids]
        src = torch.cat(list(srcs)) if len(srcs) > 1 else srcs[0]
        with self._exclusive():
            seq, ops = self.page_feed.drain() if self.page_feed is not None else (0, [])
            self._command(OP_SCATTER, ids, seq, ops)
            for rank, offset, nbytes in self._workers():
                dist.send(src[:, offset:offset + nbytes].contiguous(), dst=rank,
                          group=self.channel.data)
            self.local.scatter(ids, [src[:, :self.channel.part_nbytes[0]].contiguous()])
            ack = torch.zeros(1, dtype=torch.uint8)
            for rank, _, _ in self._workers():
                dist.recv(ack, src=rank, group=self.channel.data)

    def close(self) -> None:
        """Stop every worker's copy service (idempotent; errors are the dead worker's)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._closed = "the engine is shutting down"
            self._command(OP_STOP, [])


class CopyService:
    """A worker's thread answering the driver's copy commands for its own KV."""

    def __init__(self, local: BlockCopier, channel: CopyChannel, page_map: Any = None,
                 name: str = "worker") -> None:
        self.local = local
        self.channel = channel
        self.page_map = page_map  # an OrderedPageOps with elastic KV
        self.name = name
        self.thread = threading.Thread(target=self._serve, name="kvmem-copy-service",
                                       daemon=True)

    def start(self) -> CopyService:
        self.thread.start()
        return self

    def _serve(self) -> None:
        try:
            while True:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=0, group=self.channel.commands)
                op, ids, seq, ops = box[0]
                if op == OP_STOP:
                    return
                if op == OP_GATHER:
                    self._send_rows(ids)
                else:
                    self._receive_rows(ids, seq, ops)
        except Exception as e:  # the driver's copy fails on its own timeout
            logger.warning("%s: copy service stopped: %s", self.name, str(e).splitlines()[0])

    def _sync(self) -> None:
        if self.local.on_cuda:  # the step's KV writes (default stream) are complete
            torch.cuda.synchronize(self.local.device)

    def _send_rows(self, ids: list[int]) -> None:
        self._sync()
        rows = torch.empty((len(ids), self.local.block_nbytes), dtype=torch.uint8)
        self.local.gather(ids, [rows])
        dist.send(rows, dst=0, group=self.channel.data)

    def _receive_rows(self, ids: list[int], seq: int, ops: list) -> None:
        if self.page_map is not None and seq:
            self.page_map.apply(seq, ops)  # the blocks' pages first
        rows = torch.empty((len(ids), self.local.block_nbytes), dtype=torch.uint8)
        dist.recv(rows, src=0, group=self.channel.data)
        self.local.scatter(ids, [rows])
        self._sync()
        dist.send(torch.ones(1, dtype=torch.uint8), dst=0, group=self.channel.data)
