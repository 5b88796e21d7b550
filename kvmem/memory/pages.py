"""Page geometry: which blocks share a physical page, and where each page lives.

Layout choice: every KV slot tensor has its own contiguous range ``[num_blocks, ...]``
(the same shape as the plain backend), and a *page* is ``blocks_per_page`` consecutive
blocks. Mapping page ``p`` maps the same block range in every slot, so a block is either
backed in all slots or in none. ``page_slot_bytes`` (the bytes one page occupies in one
slot) is a multiple of the backend's granularity: the OS page on CPU, the driver's
allocation granularity (usually 2 MiB) on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, gcd

from kvmem.errors import ConfigError


def blocks_per_page_for(block_slot_bytes: int, granularity: int, min_page_bytes: int = 0) -> int:
    """Fewest whole blocks filling whole ``granularity`` units and at least ``min_page_bytes``."""
    if block_slot_bytes <= 0 or granularity <= 0:
        raise ConfigError("block bytes and page granularity must be positive")
    k = granularity // gcd(block_slot_bytes, granularity)  # lcm(block, granularity) / block
    if min_page_bytes > k * block_slot_bytes:
        k *= ceil(min_page_bytes / (k * block_slot_bytes))
    return k


@dataclass(frozen=True)
class PageGeometry:
    num_slots: int
    block_slot_bytes: int  # one block in one slot tensor
    blocks_per_page: int
    num_pages: int

    @classmethod
    def build(cls, *, num_slots: int, block_slot_bytes: int, max_blocks: int, granularity: int,
              min_page_bytes: int = 0, blocks_per_page: int | None = None) -> PageGeometry:
        if num_slots <= 0 or max_blocks <= 0:
            raise ConfigError("elastic KV storage needs at least one slot and one block")
        k = blocks_per_page or blocks_per_page_for(block_slot_bytes, granularity, min_page_bytes)
        if (k * block_slot_bytes) % granularity:
            raise ConfigError(f"{k} blocks of {block_slot_bytes} bytes do not fill whole "
                              f"{granularity}-byte pages")
        return cls(num_slots, block_slot_bytes, k, ceil(max_blocks / k))

    @property
    def num_blocks(self) -> int:
        return self.num_pages * self.blocks_per_page

    @property
    def page_slot_bytes(self) -> int:
        return self.blocks_per_page * self.block_slot_bytes

    @property
    def page_bytes(self) -> int:
        """Physical bytes one page holds across all slots."""
        return self.page_slot_bytes * self.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.num_pages * self.page_slot_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def page_of(self, block: int) -> int:
        return block // self.blocks_per_page

    def blocks_of(self, page: int) -> range:
        start = page * self.blocks_per_page
        return range(start, start + self.blocks_per_page)

    def regions(self, page: int) -> list[tuple[int, int]]:
        """(offset, length) of ``page`` in each slot's range, inside the one reservation."""
        return [(slot * self.slot_bytes + page * self.page_slot_bytes, self.page_slot_bytes)
                for slot in range(self.num_slots)]
