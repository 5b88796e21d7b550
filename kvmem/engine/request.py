"""Request: one generation's tokens, progress and state as it moves through the scheduler."""

from __future__ import annotations

import time
from enum import Enum

from kvmem.engine.errors import RequestFailure
from kvmem.engine.sampling_params import SamplingParams


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is loading from an offload tier
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # failed alone (``Request.failure`` says where and why)

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A prompt and the tokens generated for it so far.

    ``num_computed_tokens`` counts tokens whose KV is in the cache. The scheduler computes
    ``num_tokens - num_computed_tokens`` more tokens for it (a prefill chunk, or 1 for a
    decode); once all tokens are computed, the model runner samples the next token.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, prompt: str | None = None,
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.lora_name: str | None = None
        self.parent_id: str | None = None  # set on the extra samples of an n > 1 request
        self.sample_index = 0
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None  # first scheduled (monotonic seconds)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.num_preemptions = 0
        self.error: str | None = None  # failure.message
        self.failure: RequestFailure | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        # with sampling_params.logprobs / prompt_logprobs: filled by the model runner
        self.output_logprobs: list = []
        self.prompt_logprobs: list | None = \
            [None] if sampling_params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def final_num_tokens(self, max_model_len: int | None = None) -> int:
        """The most tokens it can hold by its finish: its prompt and ``max_tokens`` more,
        within ``max_model_len`` (without ``max_tokens``: the next token's)."""
        cap = self.sampling_params.max_tokens
        grown = self.num_tokens + 1
        if cap is None:
            return grown
        final = self.num_prompt_tokens + cap
        if max_model_len is not None:
            final = min(final, max_model_len)
        return max(grown, final)

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Logprobs of prompt tokens ``first + 1 ...``; those already held (a preempted
        request recomputes its prompt) are skipped."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) - 1 - first
        if skip >= 0:
            self.prompt_logprobs.extend(entries[skip:])

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (prefix hits would skip them)."""
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int | None = None) -> RequestStatus | None:
        """The finished status if the newest token ``token_id`` ends the request by a token
        rule (EOS, a stop token id, max_tokens, max_model_len); stop strings need text and
        are the detokenizer's."""
        params = self.sampling_params
        early = self.num_output_tokens < params.min_tokens  # the sampler bans both then
        if not params.ignore_eos and token_id in self.eos_token_ids and not early:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids and not early:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if max_model_len is not None and self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
