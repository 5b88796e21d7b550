"""Scheduler: continuous batching with chunked prefill under a token budget; owns every
request's state from admission to finish.

``schedule()`` first gives running requests their next tokens (a decode, or the next chunk
of a prompt), then admits waiting requests, reusing prefix-cache hits. When the block
manager reports no capacity, the newest running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue to be recomputed later. The
result is one ``SchedulerOutput`` (``kvmem.engine.step``) carrying everything the
runners need, block ids included: they never ask the block manager.

``update_from_output()`` closes the step: it advances computed tokens, appends the sampled
tokens, applies token stops (EOS, stop token ids, max_tokens, max_model_len), finishes
requests and frees their blocks. Stop strings need text, so the engine's detokenizer
applies them and finishes the request through ``finish_request``.

With offloading (an ``OffloadHooks``, ``kvmem.tiers.OffloadConnector``), a finished or
preempted request's blocks are offered to the CPU/disk tiers before they are freed (a
preempted one resumes from a tier if the pool evicts them meanwhile); a waiting request
whose prefix continues in a tier waits in this scheduler's ``loading`` queue (status
``WAITING_FOR_KV``, counted toward ``max_num_seqs``) until the connector reports its load
done; and a request short of blocks while transfers still hold some waits for them
instead of failing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvmem.cache import KVCacheManager, PrefixHit
from kvmem.cache.results import Allocation
from kvmem.engine.errors import RequestFailed, RequestFailure, request_stage
from kvmem.engine.request import Request, RequestStatus
from kvmem.engine.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvmem.errors import ConfigError


class OffloadHooks(Protocol):
    """The CPU/disk tiers as the scheduler uses them (``kvmem.tiers.OffloadConnector``)."""

    def offer(self, request: Request) -> int: ...

    def start_load(self, request: Request, hit: PrefixHit) -> bool: ...

    # per load done: (request id, computed tokens), or (request id, error) for a load that
    # failed in the tiers' code (a block that did not load intact is recomputed instead)
    def poll(self) -> list[tuple[str, int | str]]: ...

    def cancel(self, request_id: str) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


class KVMemory(Protocol):
    """KV memory whose limit other engines share (``ElasticSetup``): a refusal that fits the
    engine's own limit means "wait", not "fail"; a lowered limit means preempting."""

    def fits_limit(self, num_tokens: int) -> bool: ...

    def excess_pages(self) -> int: ...

    def want(self, num_tokens: list[int]) -> bool: ...

    def backoff(self) -> None: ...


class PageOpsSource(Protocol):
    """Rank 0's page mapping decisions, numbered, for the other ranks to replay."""

    def drain(self) -> tuple[int, list]: ...


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens whose KV was already cached

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens \
            else 0.0


@dataclass
class RequestUpdate:
    """A request that advanced in a step: its new tokens, or its finish (an error)."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, offload: OffloadHooks | None = None,
                 kv_memory: KVMemory | None = None,
                 page_ops: PageOpsSource | None = None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload
        self.kv_memory = kv_memory
        self.page_ops = page_ops
        self._align_chunks = enable_prefix_caching and \
            bool(kv_cache_manager.coordinator.state_managers)
        if self._align_chunks and max_num_batched_tokens < kv_cache_manager.block_size:
            raise ConfigError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at "
                              f"least the block size ({kv_cache_manager.block_size}) for a "
                              "linear-attention model with prefix caching")
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self._loading: dict[str, Request] = {}  # waiting for a tier load to land
        self.stats = SchedulerStats()
        self._runner_tokens: dict[str, int] = {}  # requests the runners hold: tokens they know
        self._finished_ids: set[str] = set()  # since the last step, for the runners
        self._preempted_ids: set[str] = set()
        self._failed: list[Request] = []  # finished with an error, reported by the next update

    # -- queues -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_room(self) -> bool:
        """Whether one more request may run now (``max_num_seqs``)."""
        return len(self.running) + len(self.loading) < self.max_num_seqs

    def add_running(self, request: Request, num_computed_tokens: int) -> None:
        """Run ``request`` from the next step; it already holds blocks for its first
        ``num_computed_tokens`` tokens (shared with the request it was forked from)."""
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._loading or self._failed)

    def has_work(self) -> bool:
        """Unfinished requests, or stores to the tiers that hold blocks until a step sees
        them done (then the blocks are free, and elastic memory can give their pages back)."""
        return self.has_unfinished_requests() or (self.offload is not None
                                                  and self.offload.holds_blocks)

    @property
    def loading(self) -> list[Request]:
        """Requests waiting for their prefix to load from an offload tier."""
        return list(self._loading.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self._loading)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark ``request`` finished, take it out of its queue and free its blocks."""
        if request.is_finished:
            request.status = status  # e.g. a stop string in the token that hit max_tokens
            return
        self._release(request, offer=True)
        request.status = status

    def _release(self, request: Request, *, offer: bool) -> None:
        """Take an unfinished ``request`` out of its queue and free what it holds.
        ``offer``: a running request's cached blocks go to the tiers first."""
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
            if offer and self.offload is not None:
                self.offload.offer(request)  # holds its cached blocks until copied out
        elif self._loading.pop(rid, None) is not None:
            self.offload.cancel(rid)  # frees its blocks (those a load writes held until done)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)  # nothing when it holds no blocks
        self._forget(rid)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        found = [self.requests[rid] for rid in dict.fromkeys(request_ids)
                 if rid in self.requests]
        for request in found:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return found

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._runner_tokens.pop(request_id, None)
        self._finished_ids.add(request_id)  # runners drop its state and sampling state

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.new_step()  # state checkpoints of the last step can be hit
        if self.offload is not None:
            self._admit_loaded()
        preemptions = self.stats.num_preemptions
        self._coming: bool | None = None  # asked other engines for memory this step
        if self.kv_memory is not None:
            self._shrink_to_limit()
        scheduled: list[tuple[Request, int, Allocation]] = []
        budget = self._schedule_running(scheduled, self.max_num_batched_tokens)
        if self.stats.num_preemptions == preemptions:  # else memory is short: admit nobody
            self._schedule_waiting(scheduled, budget)
        if not scheduled:  # nothing runs: what the runners must learn waits for a step
            return SchedulerOutput()
        out = SchedulerOutput(finished_req_ids=self._finished_ids,
                              preempted_req_ids=self._preempted_ids)
        self._finished_ids, self._preempted_ids = set(), set()
        for request, num_new, allocation in scheduled:
            self._add_to_step(out, request, num_new, allocation)
        if self.page_ops is not None:  # after every allocation and free of this step
            out.page_ops_seq, out.page_ops = self.page_ops.drain()
        return out

    def _add_to_step(self, out: SchedulerOutput, request: Request, num_new: int,
                     allocation: Allocation) -> None:
        rid = request.request_id
        known = self._runner_tokens.get(rid)
        if known is None:  # new to the runners, or resumed after preemption
            tables = self.kv_cache_manager.get_block_ids(rid)
            out.scheduled_new_reqs.append(NewRequestData(
                rid, list(request.all_token_ids), tuple(list(t) for t in tables),
                request.num_computed_tokens, request.sampling_params,
                request.num_prompt_tokens, request.eos_token_ids))
        else:
            out.scheduled_cached_reqs.append(CachedRequestData(
                rid, request.all_token_ids[known:], allocation.new_block_ids,
                allocation.num_null_blocks, request.num_computed_tokens))
        self._runner_tokens[rid] = request.num_tokens
        out.num_scheduled_tokens[rid] = num_new

    def update_from_output(self, out: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Close the step ``out``: advance, append samples, stop and finish requests. A
        request whose own part of the step failed (in the runner, or here) fails alone."""
        updates = [RequestUpdate(r) for r in self._failed]
        self._failed = []
        now = time.monotonic()
        for rid, num_new in out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None:  # finished between schedule and update (e.g. aborted)
                continue
            failure = runner_output.failures.get(rid)
            if failure is None:
                try:
                    token = self._advance(request, num_new, runner_output, now)
                except RequestFailed as exc:
                    failure = exc.failure
            if failure is not None:
                self.fail_request(request, failure)
                updates.append(RequestUpdate(request))
            elif token is not None:
                updates.append(RequestUpdate(request, [token]))
        return updates

    def _advance(self, request: Request, num_new: int, runner_output: ModelRunnerOutput,
                 now: float) -> int | None:
        """Apply one request's part of the step; its new token, if it sampled one."""
        rid = request.request_id
        if rid in runner_output.prompt_logprobs:
            with request_stage("logprobs"):
                request.add_prompt_logprobs(*runner_output.prompt_logprobs[rid])
        request.num_computed_tokens += num_new
        token = runner_output.sampled_token_ids.get(rid)
        if token is None:
            return None  # a partial prefill chunk: nothing to report yet
        if request.first_token_time is None:
            request.first_token_time = now
        if rid in runner_output.logprobs:
            request.output_logprobs.append(runner_output.logprobs[rid])
        request.append_output_token(token)
        with request_stage("stop"):
            status = request.check_stop(token, self.max_model_len)
        if status is not None:
            self.finish_request(request, status)
        return token

    def idle(self) -> None:
        """Called when a step scheduled nothing: wait briefly for what unblocks it."""
        if self.kv_memory is not None and self.waiting:
            self.kv_memory.backoff()  # waiting for memory other engines hold
        elif self.offload is not None and (self._loading or self.offload.holds_blocks):
            self.offload.wait(0.05)  # nothing to run until a tier load or store lands

    def _memory_coming(self) -> bool:
        """With KV memory other engines share: ask them, once a step, for what every
        running request and every waiting one a slot awaits needs by its finish (asked
        once for the burst, not again at every block a decode fills); whether they are
        giving some back (then a running request short of blocks waits for it instead of
        preempting another, whose KV would be computed again)."""
        if self.kv_memory is None:
            return False
        if self._coming is None:
            free = self.max_num_seqs - len(self.running) - len(self._loading)
            awaited = [*self.running, *list(self.waiting)[:max(0, free)]]
            demand = [r.final_num_tokens(self.max_model_len) for r in awaited]
            self._coming = self.kv_memory.want(demand)
        return self._coming

    def _shrink_to_limit(self) -> None:
        """Under a lowered KV memory limit, preempt running requests (the newest first,
        recomputed later) until what runs fits; they wait, none fails."""
        assert self.kv_memory is not None
        while self.running and self.kv_memory.excess_pages() > 0:
            self._preempt(self.running[-1])

    def _schedule_running(self, scheduled: list, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, request.num_computed_tokens, budget)
            if not num_new:  # its next chunk cannot end on a block boundary in this step
                i += 1
                continue
            while not (result := self.kv_cache_manager.allocate_slots(request, num_new)):
                if result.can_ever_fit and self._memory_coming():
                    break  # other engines give back what it needs: it waits, keeps its KV
                victim = self.running[-1]
                if not result.can_ever_fit or (victim is request and i == 0):
                    if result.can_ever_fit and (self._transfers_hold_blocks(request)
                                                or self._memory_frees_later(request)):
                        self._preempt(request)  # the blocks come back soon: wait
                    else:  # even alone there is no room: it can never run in this pool
                        self._fail(request, self._too_big(request))
                    break
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, result))
                budget -= num_new
                i += 1
                continue
            # ``request`` left the running list (preempted or failed); index i is the next one.
            if request in self.running:  # pragma: no cover - defensive
                i += 1
        return budget

    def _chunk(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens of ``request`` to compute in this step: what is left, up to ``budget``.

        With state checkpoints (a linear-attention hybrid under prefix caching) a chunk
        that does not finish the request ends on a block boundary, so that the state the
        step leaves in a block is the state at its boundary (vLLM's "align" mode); 0 when
        the budget does not reach the next boundary.
        """
        num_new = min(request.num_tokens - num_computed, budget)
        if self._align_chunks and num_computed + num_new < request.num_tokens:
            bs = self.kv_cache_manager.block_size
            num_new = (num_computed + num_new) // bs * bs - num_computed
        return max(num_new, 0)

    def _schedule_waiting(self, scheduled: list, budget: int) -> None:
        mgr = self.kv_cache_manager
        while self.waiting and budget > 0 and \
                len(self.running) + len(self._loading) < self.max_num_seqs:
            request = self.waiting[0]
            # a prefix hit would skip the positions whose prompt logprobs are asked for
            hit = mgr.get_computed_blocks(request) \
                if self.enable_prefix_caching and not request.needs_prompt_logprobs else None
            if hit is not None and self.offload is not None and self._start_load(request, hit):
                continue  # it waits for its blocks from a tier (or failed there)
            num_cached = hit.num_tokens if hit is not None else 0
            num_new = self._chunk(request, num_cached, budget)
            if not num_new:
                break  # its first chunk cannot end on a block boundary in this step
            result = mgr.allocate_slots(request, num_new, prefix_hit=hit)
            if not result:
                alone = not self.running and not self._loading and mgr.usage().held == 0
                if not result.can_ever_fit or (alone and not self._memory_frees_later(request)):
                    self.waiting.popleft()
                    self._fail(request, self._too_big(request))
                    continue
                self._memory_coming()  # ask other engines for what waits, once
                break  # wait for running requests to finish and free blocks
            self.waiting.popleft()
            self.stats.prefix_queried_tokens += request.num_tokens
            self.stats.prefix_hit_tokens += num_cached
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, result))
            budget -= num_new

    def _start_load(self, request: Request, hit: PrefixHit) -> bool:
        """Continue the waiting queue's head ``request``'s prefix ``hit`` from the tiers;
        True if it left the queue: to the loading queue, or failed (a failure in the tiers'
        code fails it alone)."""
        try:
            with request_stage("tier_load"):
                if not self.offload.start_load(request, hit):
                    return False
        except RequestFailed as exc:
            self.waiting.popleft()
            self.offload.cancel(request.request_id)  # if its load got under way
            self.fail_request(request, exc.failure, report=True)
            return True
        self.waiting.popleft()
        self.stats.prefix_queried_tokens += request.num_tokens
        request.num_computed_tokens = hit.num_tokens
        request.status = RequestStatus.WAITING_FOR_KV
        self._loading[request.request_id] = request
        return True

    def _admit_loaded(self) -> None:
        """Move requests whose tier loads the connector reports done into the running queue;
        a load that failed in the tiers' code fails its request alone."""
        for rid, num_computed in self.offload.poll():
            request = self._loading.pop(rid, None)
            if request is None:
                continue
            if isinstance(num_computed, str):  # its blocks are already freed
                self.fail_request(request, RequestFailure(
                    "tier_load", f"the request failed in tier_load: {num_computed}"), report=True)
                continue
            request.num_computed_tokens = num_computed
            if request.num_preemptions == 0:  # a first admission, not a resumption
                request.num_cached_tokens = num_computed
            self.stats.prefix_hit_tokens += num_computed
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
        return bool(mgr.usage().held or self._loading) and mgr.can_fit(request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.offload is not None:
            self.offload.offer(request)  # held until copied out, like a finished one
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        if self._runner_tokens.pop(request.request_id, None) is not None:
            self._preempted_ids.add(request.request_id)  # runners drop its blocks

    def _too_big(self, request: Request) -> str:
        return _too_big(request, elastic=self.kv_memory is not None)

    def _fail(self, request: Request, message: str) -> None:
        self.fail_request(request, RequestFailure("kv_cache", message), report=True)

    def fail_request(self, request: Request, failure: RequestFailure, *,
                     report: bool = False) -> None:
        """Finish ``request`` with ``failure`` from whatever state it is in, freeing what it
        holds (its blocks are not offered to the tiers). ``report``: its last update comes
        with the next ``update_from_output`` (else the caller reports it)."""
        if not request.is_finished:
            self._release(request, offer=False)
            if report:
                self._failed.append(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = failure.message
        request.failure = failure


def _too_big(request: Request, elastic: bool = False) -> str:
    budget = ("the elastic KV memory limit (--kv-memory-limit, or `kvmem limit` for a "
              "running engine)" if elastic else "the KV budget (--kv-cache-memory-bytes)")
    return (f"the KV cache is too small for request {request.request_id!r} "
            f"({request.num_tokens} tokens) even with nothing else running; raise "
            f"{budget} or lower max_model_len")
