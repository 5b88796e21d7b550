"""Where KV bytes live: plain tensors, or elastic pages mapped on demand.

Imports no torch at package import time; backends import it when constructed.
"""

from kvmem.memory.budget import EngineBudget
from kvmem.memory.coordinator import PageMapCoordinator
from kvmem.memory.elastic import ElasticKVStorage, ElasticStats
from kvmem.memory.ledger import Ledger
from kvmem.memory.storage import KVStorage, SlotShape
from kvmem.memory.wait import WaitTimeout, wait_for

__all__ = [
    "ElasticKVStorage", "ElasticStats", "EngineBudget", "KVStorage", "Ledger",
    "PageMapCoordinator", "SlotShape", "WaitTimeout", "wait_for",
]
