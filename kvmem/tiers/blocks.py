"""Copying whole blocks between the KV pool and host memory.

A block's content is row ``b`` of every slot tensor (``KVStorage.slot_tensor``), each of
shape ``[num_blocks, 2, block_size, kv_heads, head_dim]``. A block id belongs to one KV
group, and the slot tensors are exactly that group's layers, so copying the row of every
slot copies the block and nothing else. On the host a block is one flat ``uint8`` row of
``block_nbytes`` bytes: the slots' rows one after another.

On CUDA, copies run on a side stream after the compute stream's pending writes, and the
host buffers are pinned so the copies are true DMA.

A storage the driver cannot read directly (the other ranks' KV of a parallel engine)
brings its own copier with this interface: ``copier_for(storage, n)`` returns
``storage.block_copier(n)`` when the storage has that method, else a ``BlockCopier``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kvmem.memory.storage import KVStorage


def key_name(key: Hashable) -> str:
    """A stable file-name-safe name for a block key: a hash, or ``(group_id, hash)``."""
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

    def alloc_host(self, num_blocks: int) -> torch.Tensor:
        """Host rows for ``num_blocks`` blocks (pinned when the pool is on CUDA)."""
        return torch.empty((num_blocks, self.block_nbytes), dtype=torch.uint8,
                           pin_memory=self.on_cuda)

    def compute_done_event(self) -> torch.cuda.Event | None:
        """Mark the compute stream's current point; a later copy waits for it."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def gather(self, block_ids: Sequence[int], out: torch.Tensor,
               after: torch.cuda.Event | None = None) -> None:
        """Copy pool blocks into ``out[i]`` (host rows); returns when the bytes are there."""
        if not self.on_cuda:
            idx = torch.as_tensor(list(block_ids), dtype=torch.long)
            offset = 0
            for slot, nbytes in zip(self.slots, self.row_bytes, strict=True):
                rows = slot.index_select(0, idx).reshape(len(idx), -1).view(torch.uint8)
                out[:, offset:offset + nbytes].copy_(rows)
                offset += nbytes
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
            rows = [s.index_select(0, idx).reshape(len(idx), -1).view(torch.uint8)
                    for s in self.slots]
            out.copy_(torch.cat(rows, dim=1), non_blocking=True)
        self.stream.synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Copy host rows ``src[i]`` into pool blocks; returns when the pool holds them."""
        n = len(block_ids)
        if self.on_cuda:
            with torch.cuda.stream(self.stream):
                idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
                self._scatter_rows(idx, src.to(self.device, non_blocking=True), n)
            self.stream.synchronize()
        else:
            self._scatter_rows(torch.as_tensor(list(block_ids), dtype=torch.long), src, n)

    def _scatter_rows(self, idx: torch.Tensor, src: torch.Tensor, n: int) -> None:
        offset = 0
        for slot, nbytes in zip(self.slots, self.row_bytes, strict=True):
            part = src[:, offset:offset + nbytes].contiguous().view(slot.dtype)
            slot.index_copy_(0, idx, part.view(n, *slot.shape[1:]))
            offset += nbytes


def copier_for(storage: KVStorage, num_slots: int):  # noqa: ANN201 - a BlockCopier's interface
    """The copier of ``storage``: its own when it brings one, else a ``BlockCopier``."""
    own = getattr(storage, "block_copier", None)
    return own(num_slots) if own is not None else BlockCopier(storage, num_slots)
