"""Which blocks a tier keeps: LRU eviction, and a frequency-aware admission filter.

``LRUPolicy`` evicts the least recently stored or used block. ``SeenTwicePolicy`` evicts
the same way but admits a block only on its second offer, so a stream of one-off prompts
cannot flush blocks that are reused; it remembers recently offered keys in a bounded
history of key names only (no data).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, key: Hashable) -> bool:
        return True

    def inserted(self, key: Hashable) -> None:
        self._order[key] = None

    def touched(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        """Keys, least recently used first (a snapshot: callers may remove keys meanwhile)."""
        return iter(list(self._order))


class SeenTwicePolicy(LRUPolicy):
    name = "seen-twice"

    def __init__(self, history: int) -> None:
        super().__init__()
        self._history = max(1, history)
        self._seen_once: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, key: Hashable) -> bool:
        if key in self._seen_once:
            del self._seen_once[key]
            return True
        self._seen_once[key] = None
        if len(self._seen_once) > self._history:
            self._seen_once.popitem(last=False)
        return False


def make_policy(name: str, capacity_blocks: int) -> LRUPolicy:
    if name == "seen-twice":
        return SeenTwicePolicy(history=2 * capacity_blocks)
    return LRUPolicy()
