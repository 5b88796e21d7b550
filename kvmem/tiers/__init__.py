"""Where evicted KV goes: CPU and disk tiers with asynchronous transfers.

Blocks leave the device pool when a request finishes or is preempted (and when a cached
block is about to be reused), land in host memory and on local disk, are found again by
their prefix hash, and are loaded back into newly allocated blocks before a request
computes. See ``docs/offload.md``.
"""

from kvmem.tiers.config import OffloadConfig, TierIdentity
from kvmem.tiers.faults import Faults
from kvmem.tiers.manager import BlockHolder, OffloadManager
from kvmem.tiers.stats import TierStats
from kvmem.tiers.transfer import LoadHandle

__all__ = ["BlockHolder", "Faults", "LoadHandle", "OffloadConfig", "OffloadManager",
           "TierIdentity", "TierStats"]
