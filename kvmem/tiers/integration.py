"""Turn offloading on in a running ``kvmem.engine.LLMEngine``.

``attach_offload(engine, config)`` builds the ``OffloadManager`` over the engine's KV
storage and swaps in ``OffloadScheduler``: the engine's scheduler plus the connector's
four calls (see ``kvmem.tiers.connector``). The engine is imported lazily, so
``kvmem.tiers`` itself stays below the engine in the package layering.

Preempted requests are not offered with holds: their blocks were freed because memory is
short right now, and the pool's eviction listener copies each of them out (synchronously,
block by block) just before it is reused. A running request that cannot get blocks while
transfers still hold some waits for them instead of failing.
"""

from __future__ import annotations

from typing import Any

from kvmem.tiers.config import OffloadConfig
from kvmem.tiers.connector import OffloadConnector
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.manager import OffloadManager


def engine_identity(engine: Any) -> tuple[str, str]:
    """(model, layout) strings that name what an engine's KV blocks depend on."""
    spec = engine.spec
    model = f"{spec.name}|{spec.architecture}|{engine.config.model or 'embedded'}"
    groups = ";".join(f"{g.kind.value}:{g.window}:{','.join(map(str, g.layers))}"
                      for g in spec.kv_groups())
    return model, f"tp=1 pp=1 rank=0 groups={groups}"


def attach_offload(engine: Any, config: OffloadConfig,
                   faults: Faults = NO_FAULTS) -> OffloadConnector:
    from kvmem.engine.scheduler import Scheduler

    model, layout = engine_identity(engine)
    manager = OffloadManager(config, engine.kv_storage, engine.kv_plan.ranks[0].num_slots,
                             engine.kv_cache_manager, model=model, layout=layout, faults=faults)
    connector = OffloadConnector(manager, engine.kv_cache_manager)
    engine.scheduler = _offload_scheduler_class(Scheduler)(engine.scheduler, connector)
    engine.offload = connector
    return connector


def _offload_scheduler_class(base: type) -> type:
    from kvmem.engine.request import RequestStatus

    class OffloadScheduler(base):
        def __init__(self, scheduler: Any, connector: OffloadConnector) -> None:
            super().__init__(scheduler.kv_cache_manager, max_num_seqs=scheduler.max_num_seqs,
                             max_num_batched_tokens=scheduler.max_num_batched_tokens,
                             enable_prefix_caching=scheduler.enable_prefix_caching)
            self.waiting, self.running, self.stats = (scheduler.waiting, scheduler.running,
                                                      scheduler.stats)
            self.connector = connector

        def has_unfinished_requests(self) -> bool:
            return super().has_unfinished_requests() or bool(self.connector.loading)

        def schedule(self):
            for request in self.connector.poll():
                if request.status is RequestStatus.WAITING:
                    request.num_cached_tokens = request.num_computed_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            return super().schedule()

        def _schedule_waiting(self, out, budget: int) -> None:
            mgr = self.kv_cache_manager
            while self.waiting and len(self.running) + len(self.connector.loading) \
                    < self.max_num_seqs and self.enable_prefix_caching:
                request = self.waiting[0]
                if not self.connector.start_load(request, mgr.get_computed_blocks(request)):
                    break
                self.waiting.popleft()
                self.stats.prefix_queried_tokens += request.num_tokens
            super()._schedule_waiting(out, budget)

        def finish_request(self, request, status) -> None:
            if request in self.running:
                self.connector.offer(request)
            elif self.connector.cancel(request.request_id) is not None:
                request.status = status
                return
            super().finish_request(request, status)

        def abort_requests(self, request_ids):
            wanted = set(request_ids)
            parked = [r for r in self.connector.loading if r.request_id in wanted]
            for request in parked:
                self.finish_request(request, RequestStatus.FINISHED_ABORTED)
            return parked + super().abort_requests(wanted - {r.request_id for r in parked})

        def _fail(self, request, out, message: str) -> None:
            mgr = self.kv_cache_manager
            if request in self.running and mgr.usage().held and mgr.can_fit(request.num_tokens):
                self._preempt(request, out)  # blocks held by transfers come back soon
                return
            super()._fail(request, out, message)

    return OffloadScheduler
