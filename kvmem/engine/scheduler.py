"""Scheduler: continuous batching with chunked prefill under a token budget.

Each step first gives running requests their next tokens (a decode, or the next chunk
of a prompt), then admits waiting requests, reusing prefix-cache hits. When the block
manager reports no capacity, the newest running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue to be recomputed later.

With offloading (an ``offload`` connector, see ``kvmem.tiers.connector``), a finished or
preempted request's blocks are offered to the CPU/disk tiers before they are freed (a
preempted one resumes from a tier if the pool evicts them meanwhile), a waiting request
whose prefix continues in a tier is parked while its blocks load (it counts toward
``max_num_seqs``) and joins the running queue when the load is done, and a request
short of blocks while transfers still hold some waits for them instead of failing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmem.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's batch: each scheduled request with how many new tokens it computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # finished with an error this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens whose KV was already cached

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens \
            else 0.0


class Scheduler:
    def __init__(self, kv_cache_manager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, offload: Any = None) -> None:
        """``offload``: an ``OffloadConnector`` (CPU/disk tiers), or None for none."""
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self.stats = SchedulerStats()
        self.offload = offload
        # an elastic KV cache (kvmem.engine.elastic_setup.ElasticSetup) whose limit is shared
        # with other engines: a refusal that fits the engine's own limit means "wait"
        self.kv_memory: Any = None

    # -- queues -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_room(self) -> bool:
        """Whether one more request may run now (``max_num_seqs``)."""
        return len(self.running) + len(self.loading) < self.max_num_seqs

    def add_running(self, request: Request, num_computed_tokens: int) -> None:
        """Run ``request`` from the next step; it already holds blocks for its first
        ``num_computed_tokens`` tokens (shared with the request it was forked from)."""
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def loading(self) -> list[Request]:
        """Requests parked while their prefix loads from an offload tier."""
        return self.offload.loading if self.offload is not None else []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark ``request`` finished, take it out of its queue and free its blocks."""
        if request in self.running:
            self.running.remove(request)
            if self.offload is not None:
                self.offload.offer(request)  # holds its cached blocks until copied out
            self.kv_cache_manager.free(request)
        elif self.offload is not None and self.offload.cancel(request.request_id) is not None:
            pass  # it was parked loading: the connector freed its blocks
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        wanted = set(request_ids)
        found = [r for r in (*self.running, *self.loading, *self.waiting)
                 if r.request_id in wanted]
        for request in found:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return found

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.offload is not None:
            self._admit_loaded()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # after a preemption, memory is short: admit nobody this step
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not (result := self.kv_cache_manager.allocate_slots(request, num_new)):
                victim = self.running[-1]
                if not result.can_ever_fit or (victim is request and i == 0):
                    if result.can_ever_fit and (self._transfers_hold_blocks(request)
                                                or self._memory_frees_later(request)):
                        self._preempt(request, out)  # the blocks come back soon: wait
                    else:  # even alone there is no room: it can never run in this pool
                        self._fail(request, out, self._too_big(request))
                    break
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            # ``request`` left the running list (preempted or failed); index i is the next one.
            if request in self.running:  # pragma: no cover - defensive
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        mgr = self.kv_cache_manager
        while self.waiting and budget > 0 and \
                len(self.running) + len(self.loading) < self.max_num_seqs:
            request = self.waiting[0]
            # a prefix hit would skip the positions whose prompt logprobs are asked for
            hit = mgr.get_computed_blocks(request) \
                if self.enable_prefix_caching and not request.needs_prompt_logprobs else None
            if hit is not None and self.offload is not None and \
                    self.offload.start_load(request, hit):
                self.waiting.popleft()  # parked until its blocks arrive from a tier
                self.stats.prefix_queried_tokens += request.num_tokens
                continue
            num_cached = hit.num_tokens if hit is not None else 0
            num_new = min(request.num_tokens - num_cached, budget)
            result = mgr.allocate_slots(request, num_new, prefix_hit=hit)
            if not result:
                alone = not self.running and not self.loading and mgr.usage().held == 0
                if not result.can_ever_fit or (alone and not self._memory_frees_later(request)):
                    self.waiting.popleft()
                    self._fail(request, out, self._too_big(request))
                    continue
                break  # wait for running requests to finish and free blocks
            self.waiting.popleft()
            self.stats.prefix_queried_tokens += request.num_tokens
            self.stats.prefix_hit_tokens += num_cached
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

    def _admit_loaded(self) -> None:
        """Move requests whose tier loads are done into the running queue."""
        for request in self.offload.poll():
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = request.num_computed_tokens
            self.stats.prefix_hit_tokens += request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _memory_frees_later(self, request: Request) -> bool:
        """Other engines hold the shared KV memory this request fits in: it comes back."""
        return self.kv_memory is not None and self.kv_memory.fits_limit(request.num_tokens)

    def _transfers_hold_blocks(self, request: Request) -> bool:
        """Whether blocks now pinned by transfers would let ``request`` fit once released."""
        if self.offload is None:
            return False
        mgr = self.kv_cache_manager
        return bool(mgr.usage().held or self.loading) and mgr.can_fit(request.num_tokens)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if self.offload is not None:
            self.offload.offer(request)  # held until copied out, like a finished one
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        out.preempted.append(request)

    def _too_big(self, request: Request) -> str:
        return _too_big(request, elastic=self.kv_memory is not None)

    def _fail(self, request: Request, out: SchedulerOutput, message: str) -> None:
        if request in self.running:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        out.failed.append(request)


def _too_big(request: Request, elastic: bool = False) -> str:
    budget = ("the elastic KV memory limit (--kv-memory-limit, or `kvmem limit` for a "
              "running engine)" if elastic else "the KV budget (--kv-cache-memory-bytes)")
    return (f"the KV cache is too small for request {request.request_id!r} "
            f"({request.num_tokens} tokens) even with nothing else running; raise "
            f"{budget} or lower max_model_len")
