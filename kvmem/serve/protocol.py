"""Request bodies of the OpenAI API (the fields kvmem serves) and OpenAI-style error bodies.

Types are strict, as the OpenAI API's are: ``"max_tokens": "4"``, ``"n": true`` or
``"stream": "yes"`` are 400 errors naming the field, not coerced (an integer is still a
valid float). A field kvmem does not serve is a 400 naming it too (``response_format``,
``tools``, a misspelt ``max_token``): ignoring it would answer something the client did
not ask for. OpenAI's bookkeeping fields that change nothing in the output (``user``,
``metadata``, ``store``, ``service_tier``) are accepted.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvmem.engine.errors import InvalidRequestError
from kvmem.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_SAMPLES,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

_TokenId = Annotated[int, Field(strict=True, ge=0)]  # strict: "12" is not a token id
_NonEmpty = Field(min_length=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # The ranges are SamplingParams' (which checks them again, for every caller); stating
    # them here puts them in the OpenAPI schema.
    model: str
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM has it too)
    min_p: float | None = Field(None, ge=0, le=1)  # extension (vLLM)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(0, ge=0)  # extension (vLLM): no EOS, stop ids or strings before
    include_stop_str_in_output: bool = False  # extension (vLLM)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)  # extension (vLLM)
    # token id (as a string) -> bias
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprob tokens as token_id:N
    # OpenAI's bookkeeping: accepted, and nothing in the answer depends on them
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_supported(self) -> None:
        pass

    def logprob_settings(self) -> tuple[int | None, int | None]:
        """(top logprobs per generated token, per prompt token); None where not asked."""
        return None, None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self.check_supported()
        logprobs, prompt_logprobs = self.logprob_settings()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            n=self.n, best_of=getattr(self, "best_of", None),
            seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=self._token_bias(), logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _token_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            # decimal digits only: int() also reads " 12", "1_0" and full-width digits
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"logit_bias keys must be token ids in decimal "
                                          f"digits, got {key!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # (an empty string passes the schema and is refused: its message names the prompt)
    prompt: str | Annotated[list[str], _NonEmpty] | Annotated[list[_TokenId], _NonEmpty] | \
        Annotated[list[Annotated[list[_TokenId], _NonEmpty]], _NonEmpty]
    max_tokens: int | None = 16
    echo: bool = False
    # top logprobs per token (0: only the chosen token's)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # extension (vLLM); echo + logprobs implies it
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
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

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: score the prompt, generate nothing."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens  # one token, dropped from the answer

    def logprob_settings(self) -> tuple[int | None, int | None]:
        prompt = self.prompt_logprobs
        if prompt is None and self.echo:
            prompt = self.logprobs
        return self.logprobs, prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError("best_of > n cannot be streamed (the best samples are "
                                      "known only at the end)", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")


class TextContentPart(BaseModel):
    """The one kind of content part served: text (no images or audio)."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_settings(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0 if self.logprobs else None), None

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
