"""A page-aware free-block queue for the block pool.

It has the methods of the pool's default queue, but the order it hands blocks out in is
decided by page: blocks on mapped pages first, and among those the page with the fewest
free blocks, so a few live blocks do not keep many pages mapped. Within a page, blocks
leave in the order they were freed (least recently freed first).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmem.memory.page_table import PageTable


class PageAwareFreeQueue:
    def __init__(self, table: PageTable) -> None:
        self.table = table

    @property
    def num_free_blocks(self) -> int:
        return self.table.num_free

    def __len__(self) -> int:
        return self.table.num_free

    def popleft(self) -> int:
        return self.table.pop_free()

    def popleft_n(self, n: int) -> list[int]:
        if n > self.table.num_free:
            raise ValueError(f"asked for {n} free blocks, {self.table.num_free} are free")
        return [self.table.pop_free() for _ in range(n)]

    def append(self, block: int) -> None:
        self.table.push_free(block)

    def append_n(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.table.push_free(block)

    def remove(self, block: int) -> None:
        self.table.remove_free(block)

    def __contains__(self, block: int) -> bool:
        return self.table.is_free(block)

    def get_all_free_blocks(self) -> list[int]:
        return self.table.free_blocks()
