"""OutputProcessor: sampled tokens to text, stop strings, and each request's RequestOutput.

The scheduler closes a step with token ids; this turns them into text with one
incremental detokenizer per request, finishes a request whose newest token completed a
stop string (through ``Scheduler.finish_request``; the text is cut there), and builds the
output of every request that advanced, with the delta since its previous output. While a
request runs, text that could be the start of a stop string is held back, so a streamed
response never shows part of a stop string.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from kvmem.engine.errors import RequestFailed, RequestFailure, request_stage
from kvmem.engine.outputs import CompletionOutput, RequestOutput
from kvmem.engine.request import Request, RequestStatus
from kvmem.engine.scheduler import RequestUpdate

logger = logging.getLogger("kvmem.engine")


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class DetokenizerFactory(Protocol):
    def detokenizer(self, prompt_token_ids: list[int]) -> Detokenizer: ...


class Finisher(Protocol):
    def finish_request(self, request: Request, status: RequestStatus) -> None: ...

    def fail_request(self, request: Request, failure: RequestFailure) -> None: ...


@dataclass
class OutputStats:
    """Counters since start; ``kvmem.serve`` exports them as Prometheus metrics."""

    received_requests: int = 0
    finished_requests: Counter = field(default_factory=Counter)  # finish reason -> count
    failed_requests: Counter = field(default_factory=Counter)  # failure stage -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: DetokenizerFactory, finisher: Finisher) -> None:
        self.tokenizer = tokenizer
        self.finisher = finisher
        self.stats = OutputStats()
        self._detokenizers: dict[str, Detokenizer] = {}
        self._sent_text: dict[str, int] = {}
        self._sent_tokens: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        self.stats.received_requests += 1
        self._detokenizers[request.request_id] = self.tokenizer.detokenizer(
            request.prompt_token_ids)

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        outputs = []
        for update in updates:
            request = update.request
            for token in update.new_token_ids:
                self.stats.generation_tokens += 1
                self._add_text(request, token)
            outputs.append(self.finish(request) if request.is_finished else self.output(request))
        return outputs

    def _add_text(self, request: Request, token: int) -> None:
        """Detokenize ``token`` and apply stop strings; a failure fails the request alone."""
        previous_len = len(request.output_text)
        try:
            with request_stage("detokenize"):
                request.output_text += self._detokenizers[request.request_id].step(token)
            by_token = request.status is RequestStatus.FINISHED_STOPPED  # EOS, stop token id
            params = request.sampling_params
            with request_stage("stop"):  # no stop string before min_tokens (vLLM's rule)
                stopped = bool(params.stop) and not by_token and \
                    request.num_output_tokens >= params.min_tokens and \
                    self._check_stop_strings(request, previous_len)
        except RequestFailed as exc:
            logger.error("request %s: %s", request.request_id, exc, exc_info=exc.__cause__)
            self.finisher.fail_request(request, exc.failure)
            return
        if stopped:
            self.finisher.finish_request(request, RequestStatus.FINISHED_STOPPED)

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

    def finish(self, request: Request) -> RequestOutput:
        """The last output of a finished request; forgets it."""
        detok = self._detokenizers.get(request.request_id)
        cut_by_stop_string = isinstance(request.stop_reason, str)
        if detok is not None and not cut_by_stop_string:
            try:
                with request_stage("detokenize"):
                    request.output_text += detok.flush()  # a held-back partial character
            except RequestFailed as exc:
                logger.error("request %s: %s", request.request_id, exc, exc_info=exc.__cause__)
                self.finisher.fail_request(request, exc.failure)
        self.stats.finished_requests[request.finish_reason] += 1
        if request.parent_id is None:  # the samples of an n > 1 request share one prompt
            self.stats.prompt_tokens += request.num_prompt_tokens
        output = self.output(request)
        self._detokenizers.pop(request.request_id, None)
        self._sent_text.pop(request.request_id, None)
        self._sent_tokens.pop(request.request_id, None)
        return output

    def output(self, request: Request) -> RequestOutput:
        """The request's output so far, with the delta since its previous output."""
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
        with_logprobs = request.sampling_params.logprobs is not None
        completion = CompletionOutput(
            text=text[:visible], token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            delta_text=text[sent:visible],
            delta_token_ids=request.output_token_ids[sent_tokens:],
            logprobs=list(request.output_logprobs) if with_logprobs else None,
            delta_logprobs=request.output_logprobs[sent_tokens:] if with_logprobs else None,
            index=request.sample_index,
            cumulative_logprob=sum(e.logprob for e in request.output_logprobs)
            if with_logprobs else None)
        return RequestOutput(request_id=rid, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion],
                             finished=request.is_finished,
                             num_cached_tokens=request.num_cached_tokens, error=request.error,
                             failure=request.failure, prompt_logprobs=request.prompt_logprobs)
