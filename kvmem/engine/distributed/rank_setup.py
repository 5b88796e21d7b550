"""GroupPeers: how one rank of a parallel engine talks to the others while it starts.

``kvmem.engine.rank_builder.build_rank`` brings every rank up the same way at every world
size; this is its ``Peers`` over the engine's process groups: each phase's outcome is
exchanged over the gloo ``startup`` group (one rank's failure becomes the same clear
error on every rank), objects are all-gathered there, the elastic KV cache's ranks map
rank 0's startup pages through the rendezvous store (``PageMapCoordinator``), and with
offloading across processes that do not share KV the copy channel is opened
(``kvmem.engine.distributed.remote_copy``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kvmem.engine.distributed.errors import StartupError
from kvmem.engine.distributed.links import StageLinks
from kvmem.engine.distributed.page_ops import OrderedPageOps
from kvmem.engine.distributed.remote_copy import CopyChannel, open_copy_channel
from kvmem.engine.distributed.state import DistributedGroups
from kvmem.engine.elastic_setup import ElasticSetup
from kvmem.engine.kv_cache_setup import KVCacheSetup
from kvmem.errors import KvmemError
from kvmem.tiers.blocks import BlockCopier

logger = logging.getLogger("kvmem.engine.distributed")
T = TypeVar("T")


class GroupPeers:
    def __init__(self, groups: DistributedGroups) -> None:
        self.groups = groups
        self.parallel = groups.parallel

    def agree(self, phase: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if any rank fails, every rank raises that rank's error."""
        result, failure = None, None
        try:
            result = fn()
        except Exception as e:  # reported to every rank below, then raised there
            failure = (type(e).__name__, str(e) or repr(e), isinstance(e, KvmemError))
            if not isinstance(e, KvmemError):
                logger.exception("%s failed while %s", self.parallel.describe(), phase)
        for rank, item in enumerate(self.all_gather(failure)):
            if item is None:
                continue
            name, message, user_error = item
            if name == "FitError":
                from kvmem.plan import FitError

                raise FitError(message)  # already names the rank
            kind = "" if user_error else f"{name}: "
            raise StartupError(f"{self.parallel.describe(rank)} failed while {phase}: "
                               f"{kind}{message}")
        return result

    def all_gather(self, obj: object) -> list[Any]:
        gathered: list[Any] = [None] * self.parallel.world_size
        dist.all_gather_object(gathered, obj, group=self.groups.startup)
        return gathered

    def links(self, *, hidden_size: int, dtype: torch.dtype,
              device: torch.device) -> StageLinks:
        return StageLinks(self.groups, hidden_size=hidden_size, dtype=dtype, device=device)

    def start_elastic(self, elastic: ElasticSetup) -> None:
        elastic.start(self.groups.store, timeout=self.parallel.timeout_s)

    def page_map(self, elastic: ElasticSetup) -> OrderedPageOps | None:
        if self.parallel.rank == 0:
            return None  # rank 0 decides; the others replay
        return OrderedPageOps(elastic, self.parallel.timeout_s)

    def copy_channel(self, kv: KVCacheSetup, kv_plan) -> CopyChannel:
        return open_copy_channel(self.groups, local_copier(kv, kv_plan, self.parallel.rank))


def local_copier(kv: KVCacheSetup, kv_plan, rank: int) -> BlockCopier:
    """A block copier over this rank's own KV slots."""
    return BlockCopier(kv.storage, kv_plan.ranks[rank].num_slots)
