"""KV block accounting (no torch): the block pool, prefix hashing, per-attention-type
managers, the hybrid-model coordinator and ``KVCacheManager``, the engine's interface.

>>> from kvmem.spec import AttentionKind, KVGroup
>>> mgr = KVCacheManager([KVGroup(0, AttentionKind.FULL, None, (0,))], num_blocks=8)
>>> mgr.usage().free
7
"""

from kvmem.cache.block_pool import BlockPool
from kvmem.cache.coordinator import LOAD_BLOCK, longest_common_hit
from kvmem.cache.free_queue import FreeBlockQueue
from kvmem.cache.hashing import BlockHash, hash_block_tokens, hash_request_tokens
from kvmem.cache.kv_cache_manager import KVCacheManager
from kvmem.cache.results import (
    NULL_BLOCK_ID,
    Allocation,
    CacheUsage,
    KVCacheEvent,
    NoCapacity,
    PrefixHit,
)

__all__ = [
    "LOAD_BLOCK", "NULL_BLOCK_ID", "Allocation", "BlockHash", "BlockPool", "CacheUsage",
    "FreeBlockQueue", "KVCacheEvent", "KVCacheManager", "NoCapacity", "PrefixHit",
    "hash_block_tokens", "hash_request_tokens", "longest_common_hit",
]
