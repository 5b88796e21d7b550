"""Tensor-parallel startup of an elastic KV cache: one page map, decided on rank 0.

Rank 0 maps the null block's page (and whatever else it decided before starting its
pre-mapping thread), publishes those decisions with the page layout (pages and blocks
per page; the slot tensors behind a page may differ between pipeline stages) through a
``torch.distributed`` store, and waits for every other rank to replay them and report
ready, naming its KV memory file where it has one (the CPU), in which rank 0 then
releases the pages it gives back (``kvmem.memory.rank_files``). Only then does rank 0
start pre-mapping. Rank and world size are arguments, taken
from the engine's configuration; every wait is bounded and names what it waited for.

Later mapping decisions travel with each engine step (``drain_ops`` on rank 0,
``apply_ops`` elsewhere); ``publish``/``receive`` carry them over the store for engines
without a broadcast of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvmem.errors import ConfigError, KvmemError
from kvmem.memory.budget import BudgetState
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.page_table import PageOp
from kvmem.memory.rank_files import RankFile
from kvmem.memory.wait import wait_for


class RankMismatchError(KvmemError):
    """Ranks of one engine built different elastic KV layouts."""


def _encode(ops: list[PageOp]) -> list[list]:
    return [[op.kind, op.page] for op in ops]


def _decode(raw: list[list]) -> list[PageOp]:
    return [PageOp(kind, int(page)) for kind, page in raw]


class PageMapCoordinator:
    def __init__(self, store: Any, *, rank: int, world_size: int, timeout: float = 60.0,
                 prefix: str = "kvmem/elastic") -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.prefix = prefix

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _wait_key(self, key: str, what: str) -> bytes:
        wait_for(lambda: self.store.check([key]), timeout=self.timeout, what=what)
        return self.store.get(key)

    def startup(self, storage: ElasticKVStorage,
                reclaim: Callable[[int], int] | None = None,
                on_due: Callable[[BudgetState], None] | None = None) -> None:
        """Bring every rank to the same page map, then start rank 0's pre-mapping thread."""
        if (storage.rank, storage.world_size) != (self.rank, self.world_size):
            raise ConfigError(f"storage is rank {storage.rank}/{storage.world_size}, coordinator "
                              f"is rank {self.rank}/{self.world_size}")
        # Pages are block ranges: ranks whose slot tensors differ (pipeline stages hold
        # different layers) share one page map as long as their pages cover the same blocks.
        layout = [storage.geometry.num_pages, storage.geometry.blocks_per_page]
        if self.rank == 0:
            plan = {"layout": layout, "ops": _encode(storage.drain_ops())}
            self.store.set(self._key("plan"), json.dumps(plan))
            files = []
            for r in range(1, self.world_size):
                ready = json.loads(self._wait_key(
                    self._key("ready", r), f"rank {r} of {self.world_size} to map the startup "
                    f"KV pages (is rank {r} running?)"))
                if ready.get("file") is not None:
                    files.append(RankFile.from_json(ready["file"]))
            # every rank's pages in a memory file (the CPU): rank 0 releases them all
            if len(files) == self.world_size - 1:
                storage.connect_ranks(files)
        else:
            raw = self._wait_key(self._key("plan"),
                                 f"rank 0 to publish the KV page map (rank {self.rank} of "
                                 f"{self.world_size} is waiting; is rank 0 running?)")
            plan = json.loads(raw)
            if plan["layout"] != layout:
                raise RankMismatchError(
                    f"rank {self.rank} has KV layout (pages, blocks per page) {layout}, "
                    f"rank 0 has {plan['layout']}")
            storage.apply_ops(_decode(plan["ops"]))
            file = storage.rank_file()
            self.store.set(self._key("ready", self.rank),
                           json.dumps({"file": file and file.to_json()}))
        storage.start(reclaim=reclaim, on_due=on_due)

    def publish(self, step: int, ops: list[PageOp]) -> None:
        self.store.set(self._key("step", step), json.dumps(_encode(ops)))

    def receive(self, step: int) -> list[PageOp]:
        raw = self._wait_key(self._key("step", step),
                             f"rank 0's KV page map for step {step}")
        return _decode(json.loads(raw))
