"""Per-attention-type rules for one KV group: which blocks a prefix hit needs, which
blocks a running request no longer needs.

- Full attention (and MLA): every token attends to the whole prefix, so a prefix hit is
  the longest run of cached blocks from the start, and no block is ever dropped early.
- Sliding window ``w``: a token attends to itself and the ``w - 1`` tokens before it.
  Blocks wholly before that window are released and replaced by the null block; a prefix
  hit of ``L`` blocks needs only the blocks that hold the last ``w - 1`` tokens.
- Chunked local attention ``c``: a token attends to the tokens of its own chunk
  (positions ``[p // c * c, p]``). Blocks wholly before the current chunk are released; a
  hit needs only the blocks of the chunk it ends in.

The managers are stateless rules; block tables live in the request state of
``KVCacheManager``.
"""

from __future__ import annotations

from kvmem.cache.hashing import BlockHash
from kvmem.cache.results import NULL_BLOCK_ID
from kvmem.spec.layout import AttentionKind, KVGroup


class SingleTypeManager:
    """Rules of one KV group. Subclasses define ``first_needed_block``."""

    # True when any prefix of a valid hit is valid too (lets the coordinator truncate)
    prefix_closed = False
    # True when running requests release blocks that fell out of their attention span
    releases_blocks = False

    def __init__(self, group: KVGroup, group_index: int, block_size: int,
                 cached: dict[BlockHash, int]) -> None:
        self.group = group
        self.group_index = group_index
        self.block_size = block_size
        self.cached = cached  # this group's hash -> block id map (owned by the pool)

    def first_needed_block(self, num_tokens: int) -> int:
        """Index of the first block whose data the token at position ``num_tokens`` needs."""
        raise NotImplementedError

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """Block table prefix of the longest valid hit of at most ``max_blocks`` blocks.

        A hit of ``L`` blocks is valid when every block from ``first_needed_block(L * bs)``
        to ``L - 1`` is cached; the blocks before are null. Scans from the end: a miss at
        block ``j`` rules out every length in ``(j, L]``, so each block is looked up at most
        once.
        """
        get = self.cached.get
        length = max_blocks
        while length > 0:
            lo = self.first_needed_block(length * self.block_size)
            found: list[int] = []
            j = length - 1
            while j >= lo:
                block_id = get(hashes[j])
                if block_id is None:
                    break
                found.append(block_id)
                j -= 1
            if j < lo:
                found.reverse()
                return [NULL_BLOCK_ID] * lo + found
            length = j
        return []


class FullAttentionManager(SingleTypeManager):
    prefix_closed = True

    def first_needed_block(self, num_tokens: int) -> int:
        return 0

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_blocks: int) -> list[int]:
        get = self.cached.get
        blocks: list[int] = []
        for i in range(max_blocks):
            block_id = get(hashes[i])
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks


class SlidingWindowManager(SingleTypeManager):
    releases_blocks = True

    def __init__(self, group: KVGroup, group_index: int, block_size: int,
                 cached: dict[BlockHash, int]) -> None:
        super().__init__(group, group_index, block_size, cached)
        assert group.window
        self.window = group.window

    def first_needed_block(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1) // self.block_size


class ChunkedLocalAttentionManager(SingleTypeManager):
    releases_blocks = True

    def __init__(self, group: KVGroup, group_index: int, block_size: int,
                 cached: dict[BlockHash, int]) -> None:
        super().__init__(group, group_index, block_size, cached)
        assert group.window
        self.chunk_size = group.window

    def first_needed_block(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_size * self.chunk_size // self.block_size


def make_manager(group: KVGroup, group_index: int, block_size: int,
                 cached: dict[BlockHash, int]) -> SingleTypeManager:
    """The rules for a group's attention kind (a window-less sliding group is full attention)."""
    if group.kind is AttentionKind.SLIDING and group.window:
        return SlidingWindowManager(group, group_index, block_size, cached)
    if group.kind is AttentionKind.CHUNKED and group.window:
        return ChunkedLocalAttentionManager(group, group_index, block_size, cached)
    if group.kind is AttentionKind.LINEAR:
        raise ValueError("linear-attention layers keep per-request state, not blocks")
    return FullAttentionManager(group, group_index, block_size, cached)
