"""Errors a single request can cause; each fails that request alone and leaves the engine
serving: bad input (HTTP 4xx before the request runs), or a failure in a step's work on
that request (``RequestFailed``: its stage, counted per stage in ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from kvmem.errors import KvmemError


class InvalidRequestError(KvmemError):
    """A request the engine will not run (bad sampling values, bad prompt). HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus room for one new token) exceeds max_model_len. HTTP 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="prompt")

    @classmethod
    def for_length(cls, num_tokens: int, max_model_len: int) -> PromptTooLongError:
        return cls(f"the prompt has {num_tokens} tokens but max_model_len is {max_model_len} "
                   f"(at most {max_model_len - 1} prompt tokens)")


# The parts of a step in which one request can fail alone (its own parameters or data):
# a label of ``kvmem_requests_failed`` each.
FAILURE_STAGES = ("kv_cache", "sampling", "logit_bias", "penalties", "logprobs", "stop",
                  "detokenize", "fork", "tier_load")


@dataclass(frozen=True)
class RequestFailure:
    """Why a request failed while the others ran on: the stage and a one-line message."""

    stage: str  # one of FAILURE_STAGES
    message: str


class RequestFailed(KvmemError):
    """One request's part of a step failed; the request fails alone (``failure``)."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class request_stage:  # noqa: N801 - used as a context manager, like contextlib's
    """Turn any error raised inside into ``RequestFailed`` for ``stage``: the code inside
    works on one request's data, so its failure is that request's alone.

    A class, not a generator-based context manager: it is entered several times per request
    in every step, and costs a third as much."""

    __slots__ = ("stage",)

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or isinstance(exc, RequestFailed) or not isinstance(exc, Exception):
            return False
        detail = (str(exc).strip().splitlines() or [""])[0]
        message = f"the request failed in {self.stage}: {type(exc).__name__}" + \
            (f": {detail}" if detail else "")
        raise RequestFailed(RequestFailure(self.stage, message)) from exc
