"""/tokenize, /detokenize and /version with vLLM's request and response shapes.

``POST /tokenize`` takes a completions-style ``prompt`` (special tokens added by default)
or chat ``messages`` (rendered with the chat template, which adds them); ``POST
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
from kvmem.serve.protocol import ChatMessage


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template adds them
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

    def tokenize_ids(body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(body, TokenizeChatRequest):
            text = tokenizer.apply_chat_template(
                [m.as_template_message() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt)
        else:
            text = body.prompt
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> dict[str, Any]:
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
