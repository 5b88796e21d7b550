"""Errors a single request can cause; each maps to an HTTP 4xx and leaves the engine serving."""

from __future__ import annotations

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
