"""What the engine hands back for a request after each step (and at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.engine.errors import RequestFailure


@dataclass(frozen=True)
class PositionLogprobs:
    """One position's log-probabilities: the chosen token's and the most likely ones'."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    """The generated part of a request: all of it so far, plus what is new since last step."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # with SamplingParams.logprobs: one entry per token of token_ids / delta_token_ids
    logprobs: list[PositionLogprobs] | None = None
    delta_logprobs: list[PositionLogprobs] | None = None
    index: int = 0  # which of the request's n samples
    cumulative_logprob: float | None = None  # with logprobs: the sum over token_ids


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # the failure's message
    failure: RequestFailure | None = None  # why it failed alone (finish_reason "error")
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
