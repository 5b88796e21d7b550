"""Small value types the block manager hands to the engine, tiers and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvmem.cache.hashing import BlockHash

NULL_BLOCK_ID = 0  # pads block tables and replaces blocks that left a sliding window


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest cached prefix of a request that is valid for every KV group.

    ``num_tokens`` is a multiple of the block size and always leaves at least one prompt
    token to compute. ``blocks[g]`` is the block table prefix of group ``g`` (null blocks
    where a sliding window or attention chunk does not need the data; a state group's is
    null but for the state at its end).
    """

    num_tokens: int
    blocks: tuple[list[int], ...]
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    epoch: int = -1  # pool eviction epoch at lookup time (detects a stale hit)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


class Allocation(NamedTuple):
    """A successful ``allocate_slots`` (always truthy): the block ids added to each group's
    table (a state group's null entries before its new block included), the tokens computed
    before this step (including a prefix hit), and per group how many leading table entries
    are now the null block (empty: unchanged, no group releases blocks)."""

    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    num_null_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class NoCapacity:
    """``allocate_slots`` could not take every block it needs; nothing was changed.

    Falsy, so ``if not res:`` reads naturally. ``can_ever_fit`` is False when the request
    would not fit even in an otherwise empty pool (the engine should fail that request
    instead of waiting).
    """

    reason: str
    needed_blocks: int = 0
    available_blocks: int = 0
    can_ever_fit: bool = True

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Block counts by state. ``free + used + cached + held == total`` (null block excluded)."""

    free: int  # free with no cached data (reused first)
    used: int  # ref count > 0
    cached: int  # cached and free: evictable, least recently used first
    held: int  # ref count 0 but held by an in-flight transfer
    total: int

    @property
    def fraction_used(self) -> float:
        """Share of the pool that cannot be handed out now (in use or held)."""
        return (self.used + self.held) / self.total if self.total else 0.0


EventKind = Literal["stored", "evicted", "removed"]


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """A change to the prefix cache, for offload tiers and metrics.

    ``stored``: a full block got a hash and became findable; ``evicted``: a cached-free
    block was reused for new data; ``removed``: a hash was dropped by ``reset_prefix_cache``.
    """

    kind: EventKind
    block_hash: BlockHash
    block_id: int
    group_id: int
    parent_hash: BlockHash | None = None
