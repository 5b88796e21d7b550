"""Request bodies of the OpenAI API (the fields kvmem serves) and OpenAI-style error bodies.

Types are strict, as the OpenAI API's are: ``"max_tokens": "4"``, ``"n": true`` or
``"stream": "yes"`` are 400 errors naming the field, not coerced (an integer is still a
valid float).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvmem.engine.errors import InvalidRequestError
from kvmem.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM has it too)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if self.logprobs not in (None, False):
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequestError(f"{name} is not supported", param=name)

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self.check_supported()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # one tokenized prompt
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return list(p)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of is not supported", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [part.get("text", "") for part in content if part.get("type") == "text"]
            if len(texts) != len(content):
                raise InvalidRequestError("only text content parts are supported",
                                          param="messages")
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("a text content part's text must be a string",
                                          param="messages")
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


# -- errors -------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 503: "service_unavailable", 500: "server_error"}


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(message: str, status: int = 400, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


# pydantic's location of an error inside a union names the member type ("str",
# "list[int]", "function-after[...]"); OpenAI's ``param`` is the field path alone
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list"}


def field_path(loc: tuple[int | str, ...]) -> tuple[str | None, bool]:
    """The dotted field path of a validation error's ``loc`` (without "body" and union
    member names), and whether a union member name was cut off."""
    parts = [p for p in loc if p != "body"]
    path: list[str] = []
    for part in parts:
        if isinstance(part, str) and (part in _TYPE_NAMES or not _FIELD.fullmatch(part)):
            return ".".join(path) or None, True
        path.append(str(part))
    return ".".join(path) or None, False
