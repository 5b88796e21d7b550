"""A page-aware free-block queue for ``kvmem.cache.BlockPool``.

Same methods as the pool's default ``FreeBlockQueue``, different order: uncached free
blocks on mapped pages first, the page with the fewest free blocks first, so live blocks
pack densely and sparse pages drain; then blocks of new pages the budget has paid for;
then cached-free blocks, least recently used first (evicting prefix-cache data instead
of growing past the budget). Within a page, blocks leave in the order they were freed.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmem.memory.page_table import PageTable


class PageAwareFreeQueue:
    def __init__(self, table: PageTable) -> None:
        self.table = table

    @property
    def num_free(self) -> int:
        """Free blocks with no cached data."""
        return self.table.num_free

    @property
    def num_cached(self) -> int:
        return len(self.table.cached)

    def __len__(self) -> int:
        return self.table.num_free + len(self.table.cached)

    def pop_n(self, n: int) -> list[int]:
        return self.table.pop_n(n)

    def push_free(self, block_ids: Iterable[int]) -> None:
        self.table.push_free(block_ids)

    def push_cached(self, block_ids: Iterable[int]) -> None:
        self.table.push_cached(block_ids)

    def remove_cached(self, block_ids: Iterable[int]) -> None:
        self.table.remove_cached(block_ids)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.table.cached

    def free_ids(self) -> list[int]:
        return self.table.free_ids()

    def cached_ids(self) -> list[int]:
        return self.table.cached_ids()
