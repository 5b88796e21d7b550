"""Where KV bytes live: plain tensors, or elastic pages mapped on demand.

Imports no torch at package import time; backends import it when constructed.
"""

from kvmem.memory.storage import KVStorage, SlotShape

__all__ = ["KVStorage", "SlotShape"]
