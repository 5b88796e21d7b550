"""Where a vLLM worker's KV blocks lie in its one KV allocation, and mapping them by granule.

vLLM (0.32, 0.33) allocates a worker's whole KV cache as one buffer and describes it with
``KVCacheTensor``s: layer ``l`` of a tensor holds block ``b`` at byte
``offset + l * layer_stride + b * block_stride``. Layer-outermost layouts (vLLM CPU's
``LBHNC``) give each layer a run of blocks; block-outermost layouts put all layers of a
block together; cache groups may overlay each other. ``KVLayout`` reads any of them the
same way: the bytes of a range of blocks are the union, over tensors and layers, of each
block's extent.

``GranuleMap`` maps those bytes in units of the backend's granularity (the OS page on the
CPU, the driver's allocation granularity on a GPU). A granule that two block ranges share
(a range that does not end on a granule boundary) is mapped while either needs it: each
granule counts the ranges mapped over it. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvmem.errors import KvmemError
from kvmem.memory.backends import PageBackend


@dataclass(frozen=True)
class TensorPlacement:
    """One ``KVCacheTensor``: where its layers' blocks start and how far apart they are."""

    offset: int
    layer_stride: int
    block_stride: int
    num_layers: int

    @property
    def block_extent(self) -> int:
        """Bytes one layer holds for one block."""
        if self.num_layers == 1:
            return self.block_stride
        return min(self.block_stride, self.layer_stride)


class KVLayout:
    """The bytes of block ranges in one worker's KV buffer (``size`` bytes, ``num_blocks``
    blocks)."""

    def __init__(self, placements: Sequence[TensorPlacement], num_blocks: int, size: int) -> None:
        if not placements:
            raise KvmemError("the KV cache has no tensors to place")
        self.placements = list(placements)
        self.num_blocks = num_blocks
        self.size = size

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config) -> KVLayout:
        """From vLLM's ``KVCacheConfig`` (its ``kv_cache_tensors`` and ``num_blocks``)."""
        tensors = kv_cache_config.kv_cache_tensors
        sizes = {t.size for t in tensors}
        if len(sizes) != 1:
            raise KvmemError(f"vLLM's KV cache tensors name {len(sizes)} allocation sizes; "
                             "elastic KV memory expects one shared allocation")
        return cls([TensorPlacement(getattr(t, "offset", 0), t.layer_stride, t.block_stride,
                                    len(t.layers)) for t in tensors],
                   kv_cache_config.num_blocks, sizes.pop())

    @property
    def block_bytes(self) -> int:
        """KV bytes per block on this worker (the allocation spread over its blocks)."""
        return self.size // self.num_blocks

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """Sorted, merged ``[lo, hi)`` byte spans holding blocks ``start .. end - 1``."""
        if not 0 <= start < end <= self.num_blocks:
            raise KvmemError(f"blocks {start}..{end - 1} are outside the KV cache's "
                             f"{self.num_blocks} blocks")
        raw: list[tuple[int, int]] = []
        for p in self.placements:
            extent = p.block_extent
            for layer in range(p.num_layers):
                base = p.offset + layer * p.layer_stride
                if extent == p.block_stride:  # consecutive blocks touch: one span
                    raw.append((base + start * extent, base + end * extent))
                else:
                    raw.extend((base + b * p.block_stride, base + b * p.block_stride + extent)
                               for b in range(start, end))
        return merge(raw)


def merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class GranuleMap:
    """Maps and unmaps byte spans of a reservation through a backend, granule by granule,
    each granule mapped while at least one span over it is."""

    def __init__(self, backend: PageBackend, size: int) -> None:
        self.backend = backend
        self.granularity = g = backend.granularity
        self.counts = np.zeros(-(-size // g), dtype=np.uint32)

    def _granules(self, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        g = self.granularity
        return merge((lo // g, -(-hi // g)) for lo, hi in spans)

    def _runs(self, first: int, flags: np.ndarray) -> list[tuple[int, int]]:
        """``[start, end)`` granule runs where ``flags`` is set, ``flags[0]`` at ``first``."""
        edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.view(np.int8), [0]))))
        return [(first + int(a), first + int(b)) for a, b in zip(edges[::2], edges[1::2],
                                                                  strict=True)]

    def map(self, spans: Iterable[tuple[int, int]]) -> int:
        """Map the spans; returns the bytes newly mapped."""
        g, done = self.granularity, 0
        for a, b in self._granules(spans):
            counts = self.counts[a:b]
            for lo, hi in self._runs(a, counts == 0):
                self.backend.map(lo * g, (hi - lo) * g)
                done += (hi - lo) * g
            counts += 1
        return done

    def unmap(self, spans: Iterable[tuple[int, int]]) -> int:
        """Unmap the spans' granules that no other mapped span holds; returns those bytes."""
        g, done = self.granularity, 0
        for a, b in self._granules(spans):
            counts = self.counts[a:b]
            if not counts.all():
                raise KvmemError(f"KV bytes {a * g}..{b * g} are not all mapped")
            counts -= 1
            for lo, hi in self._runs(a, counts == 0):
                self.backend.unmap(lo * g, (hi - lo) * g)
                done += (hi - lo) * g
        return done

    @property
    def mapped_bytes(self) -> int:
        return int(np.count_nonzero(self.counts)) * self.granularity
