"""The free-block queue: which free block a new allocation gets, in O(1) per block.

Two parts: blocks with no cached data (a stack: the most recently freed are reused first,
which keeps the working set small for elastic memory) and cached-free blocks (an LRU:
still findable by a prefix lookup, evicted least recently freed first). New blocks come
from the first part while it lasts, so cached data is evicted only when nothing else is
free.

The LRU is a circular doubly linked list kept in two lists indexed by block id (vLLM
links its block objects the same way): a freed request's run joins it with two list
stores per block, and taking the oldest blocks walks it once. An ``OrderedDict`` costs a
hashed insert and a hashed delete per block, about twice as much.

``BlockPool`` talks to another queue only through the methods below, so one with the
same methods (for example one that prefers blocks on already-mapped memory pages) can be
passed as ``BlockPool(..., free_queue=...)``. This class's own lists are also walked by
the pool's hot loops (taking blocks and evicting their data, freeing a request), which
then do the queue's part in the same pass; they check the queue's type first.
"""

from __future__ import annotations

from collections.abc import Iterable


class FreeBlockQueue:
    """Free block ids: uncached ones reused first, then cached ones least recently used first."""

    __slots__ = ("_free", "_next", "_prev", "_end", "_num_cached")

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._free: list[int] = list(block_ids)
        end = max(self._free, default=-1) + 1
        self._free.reverse()  # pop() hands out the lowest ids first on a fresh pool
        # the LRU's links; index ``end`` is its head and tail (next[end] is the oldest
        # block); prev[b] is -1 while block b is not in the LRU
        self._next = [-1] * (end + 1)
        self._prev = [-1] * (end + 1)
        self._next[end] = self._prev[end] = end
        self._end = end
        self._num_cached = 0

    @property
    def num_free(self) -> int:
        """Free blocks with no cached data."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Cached-free (evictable) blocks."""
        return self._num_cached

    def __len__(self) -> int:
        return len(self._free) + self._num_cached

    def push_free(self, block_ids: list[int]) -> None:
        """Blocks that became free with no cached data, reused before every block freed
        earlier and in the order given (vLLM's order: they go to the queue's front)."""
        self._free.extend(reversed(block_ids))

    def push_cached(self, block_ids: list[int]) -> None:
        """Cached blocks whose ref count fell to 0, in order: the first is evicted first."""
        if not block_ids:
            return
        nxt, prev, end = self._next, self._prev, self._end
        last = prev[end]
        for block_id in block_ids:
            prev[block_id] = last
            nxt[last] = block_id
            last = block_id
        nxt[last] = end
        prev[end] = last
        self._num_cached += len(block_ids)

    def remove_cached(self, block_ids: list[int]) -> None:
        """Take cached-free blocks out of the queue (a prefix hit or a hold uses them)."""
        nxt, prev = self._next, self._prev
        for block_id in block_ids:
            before = prev[block_id]
            if before < 0:
                raise KeyError(block_id)
            after = nxt[block_id]
            nxt[before] = after
            prev[after] = before
            prev[block_id] = -1
        self._num_cached -= len(block_ids)

    def pop_n(self, n: int) -> list[int]:
        """Take ``n`` blocks: uncached ones first, then the least recently used cached ones.

        The caller checks capacity first and removes the hashes of cached blocks it got.
        """
        free = self._free
        if n == 1:  # the decode fast path
            if free:
                return [free.pop()]
            if self._num_cached:
                nxt, prev, end = self._next, self._prev, self._end
                oldest = nxt[end]
                after = nxt[oldest]
                nxt[end] = after
                prev[after] = end
                prev[oldest] = -1
                self._num_cached -= 1
                return [oldest]
        taken = self.pop_uncached(n)
        k = len(taken)
        if k < n:
            nxt, prev, end = self._next, self._prev, self._end
            block_id = nxt[end]
            append = taken.append
            for _ in range(n - k):
                append(block_id)
                prev[block_id] = -1
                block_id = nxt[block_id]
            nxt[end] = block_id
            prev[block_id] = end
            self._num_cached -= n - k
        return taken

    def pop_uncached(self, n: int) -> list[int]:
        """The first step of ``pop_n``: up to ``n`` blocks with no cached data, most
        recently freed first (raises, taking nothing, if fewer than ``n`` are free)."""
        free = self._free
        if n > len(free) + self._num_cached:
            raise ValueError(f"asked for {n} blocks, only {len(self)} are free")
        k = min(n, len(free))
        taken = free[len(free) - k:]
        del free[len(free) - k:]
        taken.reverse()
        return taken

    def is_cached(self, block_id: int) -> bool:
        return 0 <= block_id < self._end and self._prev[block_id] >= 0

    def free_ids(self) -> list[int]:
        return list(self._free)

    def cached_ids(self) -> list[int]:
        """Cached-free block ids, least recently used first."""
        nxt, end = self._next, self._end
        ids = []
        block_id = nxt[end]
        while block_id != end:
            ids.append(block_id)
            block_id = nxt[block_id]
        return ids
