"""LLMEngine: loads a model, sizes its KV cache with the planner and steps requests to completion.

>>> engine = LLMEngine(EngineConfig(model=None))
>>> engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
>>> while engine.has_unfinished_requests():
...     for out in engine.step(): ...
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvmem.engine.config import EngineConfig
from kvmem.engine.errors import InvalidRequestError, PromptTooLongError
from kvmem.engine.outputs import CompletionOutput, RequestOutput
from kvmem.engine.request import Request, RequestStatus
from kvmem.engine.sampler import Sampler
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.scheduler import Scheduler
from kvmem.errors import ConfigError, KvmemError

logger = logging.getLogger("kvmem.engine")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    """Counters since start; ``kvmem.serve`` exports them as Prometheus metrics."""

    received_requests: int = 0
    finished_requests: Counter = field(default_factory=Counter)  # finish reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent copy of the engine's counters and gauges, safe to read from any thread."""

    received_requests: int
    finished_requests: dict[str, int]
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

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens \
            else 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[name]


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel=None) -> None:
        """``parallel``: a kvmem.engine.distributed.ParallelConfig for rank 0 of a launch
        started outside (torchrun); by default a tp x pp config spawns local workers."""
        from kvmem.cache import KVCacheManager
        from kvmem.engine.cuda_graphs import capture_sizes
        from kvmem.engine.kv_cache_setup import allocate_kv_cache, plan_kv_cache
        from kvmem.engine.loader import resolve_model
        from kvmem.engine.model_runner import ModelRunner
        from kvmem.engine.models import build_model
        from kvmem.engine.profiler import (
            LoadedModel,
            cuda_graphs_enabled,
            measure_loaded,
            meter_for,
        )
        from kvmem.spec import spec_from_config

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        dtype_name = str(self.dtype).removeprefix("torch.")
        if config.kv_cache_dtype not in ("auto", dtype_name):
            raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype!r}: this engine stores KV "
                              f"in the model dtype ({dtype_name}); use 'auto'")

        files = resolve_model(config.model)
        self.model_name = config.served_model_name or config.model or "smollm2"
        self.tokenizer = files.tokenizer
        self.spec = spec_from_config(files.config, files.name)
        self.max_model_len = self.max_model_len_for(self.spec, config)

        self.parallel = None  # the ParallelDriver (rank 0) of a tp x pp engine
        self.elastic = None  # an ElasticSetup with --kv-memory elastic
        self._closed = False
        if config.world_size > 1 or parallel is not None:
            from kvmem.engine.distributed import start_parallel

            self.parallel = start_parallel(config, parallel, max_model_len=self.max_model_len,
                                           dtype=self.dtype, device=self.device)
            state = self.parallel.state
            model = self.model = state.model
            self.kv_plan, kv = state.kv_plan, state.kv
            self.elastic = state.elastic  # rank 0's; every rank has mapped the same pages
            self.memory_profile = None
        else:
            # a GPU without an explicit KV budget is profiled: snapshot it before the weights
            meter = None
            if self.device.type == "cuda" and config.kv_cache_memory_bytes is None:
                meter = meter_for(self.device)
                meter.start()
            model = build_model(files.config, dtype=self.dtype, device=self.device,
                                attention_backend=config.attention_backend)
            model.load_weights(files.weights())
            self.model = model

            # weights, peak activation, non-torch and CUDA-graph memory, measured before the KV
            # cache is sized so that the budget leaves room for all of them
            self.memory_profile = None
            if meter is not None:
                self.memory_profile = measure_loaded(
                    LoadedModel(model, self.spec, self.device, self.dtype, self.max_model_len,
                                self.model_name, str(files.path)), config, meter)
                logger.info("%s", self.memory_profile.summary())
            profile = self.memory_profile.to_rank_profile() if self.memory_profile else None
            self.kv_plan = plan_kv_cache(self.spec, config, device=self.device, kv_dtype=dtype_name,
                                         max_model_len=self.max_model_len, profile=profile)
            if config.kv_memory == "elastic":
                from kvmem.engine.elastic_setup import ElasticSetup

                self.elastic = ElasticSetup.for_rank(config, self.spec, self.kv_plan,
                                                     device=self.device,
                                                     max_model_len=self.max_model_len)
            kv = allocate_kv_cache(self.spec, self.kv_plan, block_size=config.block_size,
                                   dtype=self.dtype, device=self.device, elastic=self.elastic)
        self.kv_storage = kv.storage
        self.num_blocks = kv.num_blocks
        groups = self.spec.kv_groups()
        pool = self.elastic.make_pool(len(groups)) if self.elastic is not None else None
        self.kv_cache_manager = KVCacheManager(
            groups, kv.num_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=config.max_num_batched_tokens, pool=pool)
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_prefix_caching=config.enable_prefix_caching)
        if self.elastic is not None:
            self.scheduler.kv_memory = self.elastic
            if self.parallel is None:  # a parallel engine's ranks started theirs together
                self.elastic.start()  # the null page is mapped: pre-mapping may begin
        if self.parallel is not None:
            from kvmem.engine.distributed import ParallelModelRunner

            self.model_runner = ParallelModelRunner(self.parallel, self.kv_cache_manager,
                                                    num_kv_groups=len(groups))
        else:
            self.model_runner = ModelRunner(model, kv.kv_caches, self.kv_cache_manager,
                                            num_kv_groups=len(groups),
                                            block_size=config.block_size, device=self.device,
                                            sampler=Sampler(config.seed))
        if self.parallel is None and self.device.type == "cuda" and \
                cuda_graphs_enabled(config, model):
            self.model_runner.capture_cuda_graphs(capture_sizes(config.max_num_seqs),
                                                  self.max_model_len)
        self.offload = None  # an OffloadConnector when CPU/disk tiers are on
        offload = config.offload_config()
        if offload.enabled:
            from kvmem.engine.offload_setup import attach_offload

            try:
                attach_offload(self, offload)
            except BaseException:
                self.shutdown()  # the worker ranks of a parallel engine
                raise
            logger.info("KV offload: %s", offload.describe())
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict = {}  # request id -> incremental detokenizer
        self._sent_text: dict[str, int] = {}
        self._sent_tokens: dict[str, int] = {}
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d",
                    self.num_blocks, config.block_size, self.num_blocks * config.block_size,
                    self.max_model_len)

    def shutdown(self) -> None:
        """Write out queued offload stores, then stop the worker ranks of a parallel engine."""
        from kvmem.engine.offload_setup import shutdown_offload

        shutdown_offload(self)
        if self.parallel is not None:
            self.parallel.shutdown()
        if self.elastic is not None:
            self.elastic.close()  # stops pre-mapping, leaves the ledger, unmaps the KV
            self._closed = True  # a later step would touch unmapped KV memory: refuse it

    @staticmethod
    def max_model_len_for(spec, config: EngineConfig) -> int:
        """config.max_model_len checked against the model's limit, or that limit."""
        limit = spec.max_position_embeddings
        if config.max_model_len is None:
            return limit or 2048
        if limit and config.max_model_len > limit:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's "
                              f"max_position_embeddings ({limit})")
        return config.max_model_len

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
        request = Request(request_id, token_ids, params, prompt=prompt_text,
                          cache_salt=cache_salt, eos_token_ids=tuple(self.tokenizer.eos_token_ids))
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return request

    def add_request(self, request_id: str | Request, prompt: str | list[int] | None = None,
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None) -> Request:
        request = request_id if isinstance(request_id, Request) else \
            self.make_request(request_id, prompt, sampling_params, cache_salt=cache_salt)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.stats.received_requests += 1
        self._detokenizers[request.request_id] = self.tokenizer.detokenizer(
            request.prompt_token_ids)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.abort_requests(ids)
        return [self._finish(r) for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running + \
            len(self.scheduler.loading)

    # -- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that advanced."""
        if self._closed:
            raise KvmemError("the engine is shut down")
        sched = self.scheduler.schedule()
        outputs = [self._finish(r) for r in sched.failed]
        if sched.is_empty:
            if self.elastic is not None and self.scheduler.num_waiting:
                self.elastic.backoff()  # waiting for memory other engines hold
            elif self.offload is not None and self.scheduler.loading:
                self.offload.wait(0.05)  # nothing to run until a tier load lands
            return outputs
        sampled = self.model_runner.execute(sched.scheduled)
        self.stats.steps += 1
        now = time.monotonic()
        for request, num_new in sched.scheduled:
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a partial prefill chunk: nothing to report yet
            if request.first_token_time is None:
                request.first_token_time = now
            self.stats.generation_tokens += 1
            status = self._append_token(request, token)
            if status is not None:
                self.scheduler.finish_request(request, status)
                outputs.append(self._finish(request))
            else:
                outputs.append(self._output(request))
        return outputs

    def _append_token(self, request: Request, token: int) -> RequestStatus | None:
        """Add a sampled token; returns the finished status if the request stops here."""
        params = request.sampling_params
        request.append_output_token(token)
        previous_len = len(request.output_text)
        request.output_text += self._detokenizers[request.request_id].step(token)
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.stop and self._check_stop_strings(request, previous_len):
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, request: Request, previous_len: int) -> bool:
        """Cut the text at the first stop string that the newest token completed."""
        params = request.sampling_params
        text = request.output_text
        start = max(0, previous_len - max(len(s) for s in params.stop) + 1)
        hits = [(text.find(s, start), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        request.output_text = text[:index + len(stop)] if params.include_stop_str_in_output \
            else text[:index]
        request.stop_reason = stop
        return True

    def _finish(self, request: Request) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        cut_by_stop_string = isinstance(request.stop_reason, str)
        if detok is not None and not cut_by_stop_string:
            request.output_text += detok.flush()  # a held-back partial character, if any
        self.stats.finished_requests[request.finish_reason] += 1
        self.stats.prompt_tokens += request.num_prompt_tokens
        output = self._output(request)
        self.requests.pop(request.request_id, None)
        self._detokenizers.pop(request.request_id, None)
        self._sent_text.pop(request.request_id, None)
        self._sent_tokens.pop(request.request_id, None)
        return output

    def _output(self, request: Request) -> RequestOutput:
        """The request's output so far, with the delta since its previous output.

        While a request runs, text that could be the start of a stop string is held back,
        so a streamed response never shows part of a stop string.
        """
        rid = request.request_id
        text = request.output_text
        visible = len(text)
        if not request.is_finished and request.sampling_params.stop:
            visible = max(0, len(text) - max(len(s) for s in request.sampling_params.stop) + 1)
        sent = self._sent_text.get(rid, 0)
        visible = max(visible, sent)
        sent_tokens = self._sent_tokens.get(rid, 0)
        self._sent_text[rid] = visible
        self._sent_tokens[rid] = request.num_output_tokens
        completion = CompletionOutput(
            text=text[:visible], token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            delta_text=text[sent:visible],
            delta_token_ids=request.output_token_ids[sent_tokens:])
        return RequestOutput(request_id=rid, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion],
                             finished=request.is_finished,
                             num_cached_tokens=request.num_cached_tokens, error=request.error)

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
            prompt_tokens=self.stats.prompt_tokens,
            generation_tokens=self.stats.generation_tokens, steps=self.stats.steps,
            num_preemptions=sched.num_preemptions, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting, kv_blocks_total=usage.total,
            kv_blocks_free=usage.free, kv_blocks_used=usage.used, kv_blocks_cached=usage.cached,
            prefix_queried_tokens=sched.prefix_queried_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            offload=self.offload.stats() if self.offload is not None else {})

