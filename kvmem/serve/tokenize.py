"""/tokenize, /detokenize and /version with vLLM's request and response shapes.

``POST /tokenize`` takes a completions-style ``prompt`` (special tokens added by default)
or chat ``messages`` (rendered with the chat template, which adds them), exactly one of
them (both is a 400, not a silent choice); ``POST
/detokenize`` turns token ids back into text, special tokens included, so that a client
(``vllm bench serve`` among them) can cut prompts to an exact token count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

import kvmem
from kvmem.engine.errors import InvalidRequestError
from kvmem.serve.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    """vLLM's two /tokenize bodies in one: a ``prompt``, or chat ``messages``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # messages only
    # default: true for a prompt; false for messages (the chat template adds them)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def tokenize_router(tokenizer, *, max_model_len: int, vocab_size: int,
                    check_model: Callable[[str], None]) -> APIRouter:
    """The routes; ``check_model`` raises for a ``model`` that is not the served one."""
    router = APIRouter()

    class DetokenizeRequest(BaseModel):  # the schema states this model's vocabulary size
        model_config = ConfigDict(extra="ignore")

        model: str | None = None
        tokens: list[Annotated[int, Field(strict=True, ge=0, lt=vocab_size)]]

    def tokenize_ids(body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            text = tokenizer.apply_chat_template(
                [m.as_template_message() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt)
        else:
            text = body.prompt
        special = body.add_special_tokens
        return tokenizer.encode(text, add_special_tokens=body.messages is None
                                if special is None else special)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give either prompt or messages" +
                                      (", not both" if body.prompt is not None else ""),
                                      param="messages" if body.prompt is not None else "prompt")
        if body.model is not None:
            check_model(body.model)
        ids = await asyncio.to_thread(tokenize_ids, body)  # long texts take a while
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model)
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    detokenize.__annotations__["body"] = DetokenizeRequest  # a local class: not a name
    router.post("/detokenize", response_model=DetokenizeResponse)(detokenize)

    @router.get("/version", response_model=VersionResponse)
    async def version() -> dict[str, Any]:
        return {"version": kvmem.__version__}

    return router
