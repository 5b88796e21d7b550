"""Response bodies as pydantic models: they document the OpenAPI schema (the handlers build
plain dicts of the same shape) and list each route's error responses."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionResponse(_Response):
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: str


_ERRORS = {
    400: "Invalid request (bad JSON, field or value; prompt too long)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body too large",
    503: "The engine is not running",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]}
            for status in statuses}


def pin_model_name(schema: dict[str, Any], name: str) -> None:
    """State in an OpenAPI schema that request bodies' ``model`` must be ``name`` (the one
    served; any other gets a 404)."""
    for body in schema.get("components", {}).get("schemas", {}).values():
        field = body.get("properties", {}).get("model")
        if field is None:
            continue
        for option in [field, *field.get("anyOf", [])]:
            if option.get("type") == "string":
                option["enum"] = [name]


def sse_or_json(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or server-sent events of its chunks when streaming."""
    return {200: {"model": model, "description": "The result, or with `stream: true` "
                  "server-sent events (`data: {chunk}` lines, then `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
