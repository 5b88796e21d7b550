"""LLMEngine: loads a model, sizes its KV cache with the planner and steps requests to completion.

>>> engine = LLMEngine(EngineConfig(model=None))
>>> engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
>>> while engine.has_unfinished_requests():
...     for out in engine.step(): ...
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmem.engine.config import EngineConfig
from kvmem.engine.distributed.config import ParallelConfig
from kvmem.engine.elastic_setup import StepGate
from kvmem.engine.errors import (
    InvalidRequestError,
    PromptTooLongError,
    RequestFailed,
    request_stage,
)
from kvmem.engine.executor import Executor
from kvmem.engine.output_processor import OutputProcessor
from kvmem.engine.outputs import RequestOutput
from kvmem.engine.rank_builder import (  # noqa: F401 (resolve_*: part of this API)
    Alone,
    build_rank,
    rank_context,
    resolve_device,
    resolve_dtype,
)
from kvmem.engine.request import Request
from kvmem.engine.request_metrics import Histogram, RequestMetrics
from kvmem.engine.sample_groups import SampleGroup
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.scheduler import Scheduler
from kvmem.engine.step import ModelRunnerOutput
from kvmem.errors import ConfigError, KvmemError
from kvmem.tiers.config import OffloadConfig
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.stats import PrefillMeter, prefill_step_tokens

if TYPE_CHECKING:
    from kvmem.engine.distributed.driver import ParallelDriver
    from kvmem.tiers.connector import OffloadConnector

logger = logging.getLogger("kvmem.engine")

@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent copy of the engine's counters and gauges, safe to read from any thread."""

    received_requests: int
    finished_requests: dict[str, int]
    failed_requests: dict[str, int]  # kvmem.engine.errors.FAILURE_STAGES stage -> count
    prompt_tokens: int
    generation_tokens: int
    steps: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    kv_blocks_cached: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    offload: dict = field(default_factory=dict)  # tier name -> kvmem.tiers.TierStats
    elastic: object | None = None  # kvmem.memory.ElasticStats with --kv-memory elastic
    prefill_rate: float | None = None  # measured prompt tokens per second (values tier hits)
    # kvmem.engine.request_metrics.HISTOGRAMS name -> its counts
    histograms: dict[str, Histogram] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens \
            else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel: ParallelConfig | None = None, *,
                 offload: OffloadConfig | None = None, offload_faults: Faults = NO_FAULTS
                 ) -> None:
        """``parallel``: the ParallelConfig of rank 0 of a launch started outside
        (torchrun); by default a tp x pp config spawns local workers. ``offload``: tier
        settings instead of ``config``'s (``offload_faults``: injected tier faults)."""
        from kvmem.cache import KVCacheManager
        from kvmem.engine.loader import resolve_model
        from kvmem.spec import spec_from_config
        from kvmem.spec.state_groups import engine_kv_groups

        files = resolve_model(config.model, load_format=config.load_format)
        self.config = config
        self.model_name = config.served_model_name or config.model or "smollm2"
        self.tokenizer = files.tokenizer
        self.spec = spec_from_config(files.config, files.name)
        ctx = rank_context(config, self.spec, parallel)
        config = self.config = ctx.config  # its block size holds a linear-attention state
        self.device, self.dtype = ctx.device, ctx.torch_dtype
        if config.kv_cache_dtype not in ("auto", ctx.dtype):
            raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype!r}: this engine stores KV "
                              f"in the model dtype ({ctx.dtype}); use 'auto'")
        self.max_model_len = ctx.max_model_len

        # Held around everything that changes request or block state: elastic memory gives
        # pages back to other engines between steps (the engine loop's, or, without one,
        # its memory thread's, under this lock). Made first: the ranks' set-up takes it.
        self.steps = StepGate()
        self._lock = self.steps.lock
        # every rank, this one included, is built by kvmem.engine.rank_builder.build_rank
        self.parallel: ParallelDriver | None = None  # rank 0's driver of a tp x pp engine
        self._closed = False
        if ctx.parallel.world_size > 1:
            from kvmem.engine.distributed.driver import start_parallel

            self.parallel = start_parallel(ctx, self.steps)
            state = self.parallel.state
        else:
            state = build_rank(ctx, Alone(), self.steps)
        self.rank_state = state
        self.model, self.kv_plan = state.model, state.kv_plan
        self.elastic = state.elastic  # rank 0's; every rank has mapped the same pages
        self.memory_profile = state.memory_profile
        self.kv_storage = state.kv.storage
        self.num_blocks = state.kv.num_blocks
        self.model_runner = state.runner
        self.executor = Executor(self.model_runner, self.parallel)
        groups = engine_kv_groups(self.spec)  # and state groups of linear attention
        # no prefix-cache events: nothing in this engine reads them (vLLM's connector does)
        pool = (self.elastic.make_pool(len(groups), enable_events=False)
                if self.elastic is not None else None)
        self.kv_cache_manager = KVCacheManager(
            groups, self.num_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=config.max_num_batched_tokens, pool=pool,
            enable_events=False)
        self.offload: OffloadConnector | None = None  # CPU/disk tiers
        self.prefill = PrefillMeter()  # values the tiers' hits in prefill seconds saved
        try:
            self.offload = self._build_offload(offload or config.offload_config(),
                                               offload_faults)
            self.scheduler = Scheduler(
                self.kv_cache_manager, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching, offload=self.offload,
                kv_memory=self.elastic,
                page_ops=self.parallel.page_feed if self.parallel is not None else None)
        except BaseException:
            self.shutdown()  # the worker ranks of a parallel engine
            raise
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.stats = self.output_processor.stats
        self.request_metrics = RequestMetrics(self.max_model_len)
        self.groups: dict[str, SampleGroup] = {}  # n > 1 requests by id
        self._group_of: dict[str, SampleGroup] = {}  # every sample's request id -> its group
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d",
                    self.num_blocks, config.block_size, self.num_blocks * config.block_size,
                    self.max_model_len)

    def _build_offload(self, offload: OffloadConfig, faults: Faults) -> OffloadConnector | None:
        """The tiers over every rank's KV (rank 0's own, or all of them seen from here)."""
        from kvmem.engine.offload_setup import build_offload, tier_identity

        if not offload.enabled:
            return None
        if self.parallel is not None:
            from kvmem.engine.distributed.offload import parallel_kv_storage

            self.offload_storage = parallel_kv_storage(self.parallel)
            num_slots = self.offload_storage.num_slots
        else:
            self.offload_storage = self.kv_storage
            num_slots = self.kv_plan.ranks[0].num_slots
        tp = self.config.tensor_parallel_size
        partition = [len(a.layers) for a in self.rank_state.allocations[::tp]]
        dummy = self.config.seed if self.config.load_format == "dummy" else None
        identity = tier_identity(self.spec, self.dtype, self.config.model,
                                 tensor_parallel_size=tp, partition=partition, dummy_seed=dummy)
        connector = build_offload(offload, self.kv_cache_manager, self.offload_storage,
                                  num_slots, identity, faults, self.prefill)
        logger.info("KV offload: %s", offload.describe())
        return connector

    def shutdown(self) -> None:
        """Write out queued offload stores, then stop the worker ranks of a parallel engine."""
        from kvmem.engine.offload_setup import shutdown_offload

        shutdown_offload(self.offload)
        self.executor.shutdown()  # the worker ranks of a parallel engine
        if self.elastic is not None:
            self.elastic.close()  # stops pre-mapping, leaves the ledger, unmaps the KV
            self._closed = True  # a later step would touch unmapped KV memory: refuse it

    # -- requests ---------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | list[int],
                     sampling_params: SamplingParams | None = None, *,
                     cache_salt: str | None = None) -> Request:
        """Tokenize and validate a request without touching engine state (thread-safe)."""
        params = sampling_params or SamplingParams()
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, max_model_len=self.max_model_len)
        else:
            prompt_text, token_ids = None, list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise PromptTooLongError.for_length(n, limit)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise PromptTooLongError(
                f"{n} prompt tokens + max_tokens {params.max_tokens} = {n + params.max_tokens} "
                f"exceeds max_model_len {limit}; lower max_tokens or shorten the prompt")
        vocab = self.spec.vocab_size  # checked after the length: at most max_model_len ids
        if prompt_text is None and not all(isinstance(t, int) and 0 <= t < vocab
                                           for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})",
                                      param="prompt")
        if prompt_text is not None and max(token_ids) >= vocab:  # a step would fail on it
            raise InvalidRequestError(f"the prompt tokenizes to token id {max(token_ids)}, "
                                      f"beyond the model's vocabulary of {vocab}: the "
                                      "tokenizer does not match the model", param="prompt")
        self._check_supported(params)
        if params.best_of is not None and params.best_of > params.n and params.logprobs is None:
            params.logprobs = 0  # picking the best samples needs their cumulative logprobs
        return Request(request_id, token_ids, params, prompt=prompt_text, cache_salt=cache_salt,
                       eos_token_ids=tuple(self.tokenizer.eos_token_ids))

    def add_request(self, request_id: str | Request, prompt: str | list[int] | None = None,
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None) -> Request:
        request = request_id if isinstance(request_id, Request) else \
            self.make_request(request_id, prompt, sampling_params, cache_salt=cache_salt)
        with self._lock:
            return self._add(request)

    def _add(self, request: Request) -> Request:
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.output_processor.add_request(request)
        if request.sampling_params.num_samples > 1:
            group = self.groups[request.request_id] = SampleGroup(request)
            self._group_of[request.request_id] = group
        self.scheduler.add_request(request)
        return request

    def _check_supported(self, params: SamplingParams) -> None:
        vocab = self.spec.vocab_size
        for name in ("logit_bias", "stop_token_ids"):  # ids the model can never produce
            if any(t >= vocab for t in getattr(params, name)):
                raise InvalidRequestError(f"{name} token ids must be below the vocabulary "
                                          f"size ({vocab})", param=name)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise InvalidRequestError(f"{name} must be at most the vocabulary size "
                                          f"({vocab})", param=name)
        if self.parallel is not None:  # logprobs and histories stay on the sampling rank
            for name, unset in (("logprobs", None), ("prompt_logprobs", None),
                                ("logit_bias", {}), ("presence_penalty", 0.0),
                                ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
                if getattr(params, name) != unset:
                    raise InvalidRequestError(f"{name} is not supported by a tensor/pipeline "
                                              f"parallel engine yet", param=name)
            if params.best_of is not None and params.best_of > params.n:  # needs logprobs
                raise InvalidRequestError("best_of > n is not supported by a tensor/pipeline "
                                          "parallel engine yet", param="best_of")

    def _fork(self, group: SampleGroup) -> None:
        """Start the other samples of ``group`` on the parent's prompt blocks (its prompt was
        computed this step); a child that cannot share them queues to compute its own. A
        failure here fails the group alone."""
        try:
            with request_stage("fork"):
                self._start_children(group)
        except RequestFailed as exc:
            logger.error("request %s: %s", group.request_id, exc, exc_info=exc.__cause__)
            for member in group.members:
                self._group_of[member.request_id] = group
                self.scheduler.fail_request(member, exc.failure, report=True)

    def _start_children(self, group: SampleGroup) -> None:
        for child in group.make_children():
            self._group_of[child.request_id] = group
            self.output_processor.add_request(child)
            self.stats.received_requests -= 1  # one request, however many samples
            if self.scheduler.has_room() and self.kv_cache_manager.fork(group.parent, child):
                self.scheduler.add_running(child,
                                           self.kv_cache_manager.num_computed_tokens(
                                               child.request_id))
            else:
                self.scheduler.add_request(child)

    def _group_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs with the samples of each n > 1 request merged into one output."""
        result: list[RequestOutput] = []
        advanced: dict[str, dict] = {}
        for out in outputs:
            group = self._group_of.get(out.request_id)
            if group is None:
                result.append(out)
            else:
                advanced.setdefault(group.request_id, {})[out.outputs[0].index] = out.outputs[0]
        for group_id, samples in advanced.items():
            group = self.groups[group_id]
            out = group.output(samples)
            result.append(out)
            if out.finished:
                del self.groups[group_id]
                for member in group.members:
                    self._group_of.pop(member.request_id, None)
        return result

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id."""
        return self.scheduler.requests

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        with self._lock:
            return self._abort(request_ids)

    def _abort(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids += [m.request_id for rid in ids if rid in self.groups
                for m in self.groups[rid].members[1:]]
        aborted = self.scheduler.abort_requests(ids)
        now = time.monotonic()
        for request in aborted:
            self.request_metrics.finished(request, now)
        return self._group_outputs([self.output_processor.finish(r) for r in aborted])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def wake_for_memory(self, wake: Callable[[], None] | None) -> None:
        """An engine loop that calls ``apply_memory`` between steps: ``wake()`` wakes it
        when elastic memory has something to give back (None: the loop has stopped)."""
        self.steps.wake_loop = wake

    def apply_memory(self) -> None:
        """Give back, between steps, what other engines asked elastic memory for."""
        if self.elastic is not None:
            with self._lock:
                self.elastic.apply_due()

    def has_work(self) -> bool:
        """Whether a step would do anything: unfinished requests, or tier stores whose
        blocks a step releases once copied."""
        return self.scheduler.has_work()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # -- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that advanced."""
        if self._closed:
            raise KvmemError("the engine is shut down")
        with self._lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self.elastic is not None:
            self.elastic.apply_due()  # a step boundary
        scheduled = self.scheduler.schedule()
        start = time.monotonic()
        for rid in scheduled.num_scheduled_tokens:
            self.request_metrics.scheduled(self.scheduler.requests[rid], start)
        if scheduled.is_empty:
            runner_output = ModelRunnerOutput()
        else:
            runner_output = self.executor.execute_model(scheduled)
            self.stats.steps += 1
            self.prefill.observe(prefill_step_tokens(scheduled.num_scheduled_tokens.values()),
                                 time.monotonic() - start)
        for rid in runner_output.sampled_token_ids:
            group = self.groups.get(rid)
            if group is not None and not group.forked:
                self._fork(group)  # before the parent may finish and free its blocks
        updates = self.scheduler.update_from_output(scheduled, runner_output)
        if scheduled.is_empty and not updates:
            self.scheduler.idle()
        now = time.monotonic()
        for update in updates:
            if update.new_token_ids:
                self.request_metrics.token(update.request, now)
        outputs = self.output_processor.process(updates)
        for update in updates:
            if update.request.is_finished:
                self.request_metrics.finished(update.request, now)
        outputs += self._stop_siblings_of_failed(updates, now)
        grouped = self._group_outputs(outputs)
        for out in grouped:
            if out.finished and out.failure is not None:
                self.stats.failed_requests[out.failure.stage] += 1
        return grouped

    def _stop_siblings_of_failed(self, updates: list, now: float) -> list[RequestOutput]:
        """A sample of an n > 1 request failed: the request fails, so its other samples stop
        (their outputs, to be merged into the group's)."""
        siblings = [m.request_id for u in updates if u.request.failure is not None
                    and (group := self._group_of.get(u.request.request_id)) is not None
                    for m in group.members if not m.is_finished]
        stopped = self.scheduler.abort_requests(siblings)
        for request in stopped:
            self.request_metrics.finished(request, now)
        return [self.output_processor.finish(r) for r in stopped]

    # -- introspection ----------------------------------------------------------------
    @property
    def num_preemptions(self) -> int:
        return self.scheduler.stats.num_preemptions

    def kv_usage(self):
        return self.kv_cache_manager.usage()

    def snapshot(self) -> EngineSnapshot:
        usage = self.kv_cache_manager.usage()
        sched = self.scheduler.stats
        return EngineSnapshot(
            received_requests=self.stats.received_requests,
            finished_requests=dict(self.stats.finished_requests),
            failed_requests=dict(self.stats.failed_requests),
            prompt_tokens=self.stats.prompt_tokens,
            generation_tokens=self.stats.generation_tokens, steps=self.stats.steps,
            num_preemptions=sched.num_preemptions, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting, kv_blocks_total=usage.total,
            kv_blocks_free=usage.free, kv_blocks_used=usage.used, kv_blocks_cached=usage.cached,
            prefix_queried_tokens=sched.prefix_queried_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            offload=self.offload.stats() if self.offload is not None else {},
            elastic=self.kv_storage.stats() if self.elastic is not None else None,
            prefill_rate=self.prefill.rate(),
            histograms=self.request_metrics.snapshot())

