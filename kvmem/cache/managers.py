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
- State (linear attention: GDN, Mamba2; any kind without per-token KV): a request keeps
  one recurrent state, one block. Without prefix caching (vLLM's ``mamba_cache_mode``
  "none") that block is the whole table. With prefix caching ("align") table entry ``i``
  holds the state after ``(i + 1) * block_size`` tokens: a step that crosses into a new
  block gets one new block at its end (the entries between are null), the block of an
  earlier boundary is released once the next one is computed (it stays findable by hash
  while nothing evicts it), and a hit of ``L`` blocks needs only the state at its end.

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
    # True for a recurrent-state group (``StateManager``): its tables grow by ``grow``
    holds_state = False

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


class StateManager(SingleTypeManager):
    """One recurrent state per request, with checkpoints at block boundaries under prefix
    caching ("align") or a single block for the whole request ("none")."""

    holds_state = True

    def __init__(self, group: KVGroup, group_index: int, block_size: int,
                 cached: dict[BlockHash, int], *, checkpoints: bool) -> None:
        super().__init__(group, group_index, block_size, cached)
        self.checkpoints = checkpoints
        self.releases_blocks = checkpoints

    def first_needed_block(self, num_tokens: int) -> int:
        # the state after num_tokens tokens lives in the block that ends at that token
        if not self.checkpoints or num_tokens <= 0:
            return 0
        return (num_tokens - 1) // self.block_size

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """The longest hit ends at the last cached state checkpoint within ``max_blocks``."""
        if not self.checkpoints:
            return []
        get = self.cached.get
        for i in range(max_blocks - 1, -1, -1):
            block_id = get(hashes[i])
            if block_id is not None:
                return [NULL_BLOCK_ID] * i + [block_id]
        return []

    def grow(self, num_required: int, table_len: int) -> tuple[int, int]:
        """(null entries, new blocks) that bring a table of ``table_len`` entries to cover
        ``num_required`` blocks' worth of tokens: new blocks only at the end."""
        if not self.checkpoints:
            return 0, int(table_len == 0 and num_required > 0)
        if num_required <= table_len:
            return 0, 0
        return num_required - 1 - table_len, 1

    def max_blocks_held(self, num_required: int, num_computed: int) -> int:
        """Most blocks a request holds once its table covers ``num_required`` blocks with
        ``num_computed`` tokens computed: the running state and, under checkpoints, the
        new block it is carried into."""
        if not self.checkpoints or num_required <= 1 or num_computed <= 0:
            return min(1, num_required)
        return 1 + int(self.first_needed_block(num_computed) < num_required - 1)


def is_state_group(group: KVGroup) -> bool:
    """Whether the group's layers keep a recurrent state instead of per-token KV."""
    return not group.kind.uses_blocks


def make_manager(group: KVGroup, group_index: int, block_size: int,
                 cached: dict[BlockHash, int], *, state_checkpoints: bool = True
                 ) -> SingleTypeManager:
    """The rules for a group's attention kind (a window-less sliding group is full attention).

    ``state_checkpoints``: whether state groups cache their state at block boundaries
    (prefix caching on, vLLM's "align"); without, each request holds one state block.
    """
    if group.kind is AttentionKind.SLIDING and group.window:
        return SlidingWindowManager(group, group_index, block_size, cached)
    if group.kind is AttentionKind.CHUNKED and group.window:
        return ChunkedLocalAttentionManager(group, group_index, block_size, cached)
    if is_state_group(group):
        return StateManager(group, group_index, block_size, cached,
                            checkpoints=state_checkpoints)
    return FullAttentionManager(group, group_index, block_size, cached)
