"""Copying whole blocks between the KV pool and host memory.

A block's content is row ``b`` of every slot tensor (``KVStorage.slot_tensor``), each of
shape ``[num_blocks, 2, block_size, kv_heads, head_dim]``. A block id belongs to one KV
group, and the slot tensors are exactly that group's layers, so copying the row of every
slot copies the block and nothing else. On the host a block is one flat ``uint8`` row of
``block_nbytes`` bytes: the slots' rows one after another.

On CUDA, copies run on a side stream after the compute stream's pending writes, and the
host rows are pinned (allocated once, ``host_rows``) so the copies are true DMA; a copy
moves a job's blocks as one device tensor to or from a few runs of host rows.

A storage the driver cannot read directly (the other ranks' KV of a parallel engine)
brings its own copier with this interface: ``copier_for(storage, n)`` returns
``storage.block_copier(n)`` when the storage has that method, else a ``BlockCopier``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager

import torch

from kvmem.memory.storage import KVStorage


def key_name(key: Hashable) -> str:
    """A stable file-name-safe name for a block key: a hash, or ``(group_id, hash)``."""
    if type(key) is tuple and len(key) == 2 and type(key[0]) is int \
            and type(key[1]) is bytes:  # the pool's keys, named hundreds at a time
        return f"g{key[0]}-{key[1].hex()}"
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int):
        return f"g{key[0]}-{key_name(key[1])}"
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).hex()
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return f"{key:032x}"
    raise TypeError(f"block keys are non-negative ints, bytes or (group_id, hash); got {key!r}")


class BlockCopier:
    """Gathers pool blocks into host rows and scatters host rows into pool blocks."""

    def __init__(self, storage: KVStorage, num_slots: int) -> None:
        self.slots = [storage.slot_tensor(s) for s in range(num_slots)]
        self.row_bytes = [t[0].numel() * t.element_size() for t in self.slots]
        self.block_nbytes = sum(self.row_bytes)
        self.device = self.slots[0].device
        self.on_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None

    def compute_done_event(self) -> torch.cuda.Event | None:
        """Mark the compute stream's current point; a later copy waits for it."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def gather(self, block_ids: Sequence[int], outs: Sequence[torch.Tensor],
               after: torch.cuda.Event | None = None) -> None:
        """Copy pool blocks into host rows: ``outs`` are 2-D host tensors (runs of rows,
        ``host_rows.runs``) taking the blocks in order; returns when the bytes are there."""
        with self._side_stream(after):
            idx = self._index(block_ids)
            parts = [s.index_select(0, idx).reshape(len(idx), -1).view(torch.uint8)
                     for s in self.slots]
            if self.on_cuda:  # one device tensor, then one DMA per run of host rows
                parts, columns = [torch.cat(parts, dim=1)], [slice(None)]
            else:  # host to host: each slot's part straight into its columns
                offsets = [sum(self.row_bytes[:i]) for i in range(len(self.slots) + 1)]
                columns = [slice(a, b) for a, b in zip(offsets, offsets[1:], strict=False)]
            for part, cols in zip(parts, columns, strict=True):
                first = 0
                for out in outs:
                    out[:, cols].copy_(part[first:first + len(out)], non_blocking=self.on_cuda)
                    first += len(out)
        self._wait()

    def scatter(self, block_ids: Sequence[int], srcs: Sequence[torch.Tensor]) -> None:
        """Copy host rows into pool blocks: ``srcs`` are 2-D host tensors (runs of rows)
        giving the blocks in order; returns when the pool holds them."""
        n = len(block_ids)
        with self._side_stream():
            idx = self._index(block_ids)
            if self.on_cuda or len(srcs) > 1:
                rows = torch.empty((n, self.block_nbytes), dtype=torch.uint8, device=self.device)
                offset = 0
                for src in srcs:
                    rows[offset:offset + len(src)].copy_(src, non_blocking=self.on_cuda)
                    offset += len(src)
            else:
                rows = srcs[0]
            offset = 0
            for slot, nbytes in zip(self.slots, self.row_bytes, strict=True):
                part = rows[:, offset:offset + nbytes].contiguous().view(slot.dtype)
                slot.index_copy_(0, idx, part.view(n, *slot.shape[1:]))
                offset += nbytes
        self._wait()

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)

    @contextmanager
    def _side_stream(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """On CUDA, the copy stream (after ``after``, the compute stream's writes)."""
        if not self.on_cuda:
            yield
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield

    def _wait(self) -> None:
        if self.on_cuda:
            self.stream.synchronize()


def copier_for(storage: KVStorage, num_slots: int):  # noqa: ANN201 - a BlockCopier's interface
    """The copier of ``storage``: its own when it brings one, else a ``BlockCopier``."""
    own = getattr(storage, "block_copier", None)
    return own(num_slots) if own is not None else BlockCopier(storage, num_slots)
