"""The FastAPI app: OpenAI-compatible completions and chat, models, health and metrics.

Bad input never reaches the engine: the API key and the body size are checked before the
body is read (kvmem.serve.middleware), bodies are validated by pydantic and SamplingParams,
prompts are tokenized (on a worker thread, so the event loop keeps answering) and checked
against max_model_len before a request is queued, and every failure becomes a 4xx with an
OpenAI-style ``{"error": {...}}`` body. A client that disconnects, streaming or not, aborts
its requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvmem
from kvmem.engine.async_engine import AsyncLLMEngine, EngineError
from kvmem.engine.errors import InvalidRequestError, PromptTooLongError
from kvmem.engine.outputs import CompletionOutput, RequestOutput
from kvmem.engine.request import Request as EngineRequest
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.tokenizer import check_unicode
from kvmem.errors import KvmemError
from kvmem.memory.http_control import ControlError, KVCacheControl, KVCacheControlMiddleware
from kvmem.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from kvmem.serve.metrics import make_registry
from kvmem.serve.middleware import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    APIKeyMiddleware,
    BodyLimitMiddleware,
)
from kvmem.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    error_response,
    field_path,
)
from kvmem.serve.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    HealthResponse,
    ModelList,
    errors,
    pin_model_name,
    sse_or_json,
)
from kvmem.serve.tokenize import tokenize_router

# How often a non-streaming request checks that its client is still connected.
DISCONNECT_POLL_S = 0.2
# The status logged for a response nobody receives (nginx's "client closed request").
_CLIENT_CLOSED = 499


def _kv_control(engine: AsyncLLMEngine) -> KVCacheControl:
    """``/kvcache/*`` for this engine's elastic KV memory (behind the API key, if any)."""
    elastic = engine.engine.elastic
    if elastic is None:
        def name() -> str:
            raise ControlError(409, "this engine's KV memory is not elastic (start kvmem serve "
                                    "with --kv-memory elastic)")

        return KVCacheControl(name)
    return KVCacheControl(elastic.name, reserved_bytes=elastic.sizing.reserved_bytes)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def create_app(engine: AsyncLLMEngine, *, api_key: str | None = None,
               model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               request_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               public_metrics: bool = False) -> FastAPI:
    """An app serving ``engine``; the engine thread starts and stops with the app.

    With ``api_key``, every route but /health (and /metrics if ``public_metrics``)
    requires it. Bodies over ``max_request_bytes`` are refused with 413, bodies that have
    not arrived within ``request_body_timeout_s`` with 408."""
    name = model_name or engine.engine.model_name
    tokenizer = engine.engine.tokenizer
    registry = make_registry(lambda: engine.snapshot, name)
    texts = TokenTexts(tokenizer)
    id_texts = texts.ids()

    def texts_for(body) -> TokenTexts:
        return id_texts if body.return_tokens_as_token_ids else texts
    created_at = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvmem", version=kvmem.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    _install_error_handlers(app)
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            pin_model_name(default_openapi(), name)
        return app.openapi_schema

    app.openapi = openapi

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes,
                       timeout_s=request_body_timeout_s)
    app.add_middleware(KVCacheControlMiddleware, control=_kv_control(engine))
    if api_key is not None:  # added last, so it runs first: before the body is read
        open_paths = {"/health", "/metrics"} if public_metrics else {"/health"}
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)

    def check_model(requested: str) -> None:
        if requested != name:
            raise _HTTPError(404, f"the model {requested!r} does not exist; this server serves "
                             f"{name!r}", param="model", code="model_not_found")
        if not engine.is_ready:
            raise _HTTPError(503, "the engine is not ready")

    async def make_request(prompt: str | list[int], params: SamplingParams) -> EngineRequest:
        # tokenizing a long prompt takes seconds: not on the event loop
        return await asyncio.to_thread(engine.make_request, prompt, params)

    def chat_prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
        for i, m in enumerate(messages):
            check_unicode(m["content"], f"messages.{i}.content")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template adds the special tokens; the text holds the messages' contents
        return tokenizer.encode(text, add_special_tokens=False, param="messages",
                                max_model_len=engine.engine.max_model_len)

    app.include_router(tokenize_router(
        tokenizer, max_model_len=engine.engine.max_model_len,
        vocab_size=engine.engine.spec.vocab_size, check_model=check_model),
        responses=errors(400, 401, 404, 413, 503))

    @app.get("/health", response_model=HealthResponse, responses=errors(503))
    async def health() -> Response:
        if engine.is_ready:
            return JSONResponse({"status": "ok"})
        return error_response("the engine is not ready", 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=errors(401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created_at, "owned_by": "kvmem",
            "max_model_len": engine.engine.max_model_len}]}

    @app.post("/v1/completions",
              responses={**sse_or_json(CompletionResponse), **errors(400, 401, 404, 413, 503)})
    async def completions(body: CompletionRequest, http: Request) -> Response:
        check_model(body.model)
        prompts = body.prompts()
        if body.stream and len(prompts) > 1:
            raise InvalidRequestError("streaming supports one prompt per request", "prompt")
        params = body.sampling_params(body.engine_max_tokens)  # checked before any tokenizing
        requests = [await make_request(p, params) for p in prompts]
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if body.stream:
            return _sse(_completion_chunks(engine, requests[0], meta, body, texts_for(body)))
        finals = await _finals_unless_disconnected(engine, requests, http)
        if finals is None:
            return Response(status_code=_CLIENT_CLOSED)
        if body.echo_only:
            finals = [_without_generated(out) for out in finals]
        choices = [_completion_choice(i * len(out.outputs) + c.index, out, c, body,
                                      texts_for(body))
                   for i, out in enumerate(finals) for c in out.outputs]
        return JSONResponse({**meta, "object": "text_completion", "choices": choices,
                             "usage": _usage(finals)})

    @app.post("/v1/chat/completions", responses={**sse_or_json(ChatCompletionResponse),
                                                 **errors(400, 401, 404, 413, 503)})
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        check_model(body.model)
        params = body.sampling_params(body.effective_max_tokens)
        messages = [m.as_template_message() for m in body.messages]
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, messages)
        request = await make_request(prompt_ids, params)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if body.stream:
            return _sse(_chat_chunks(engine, request, meta, body.include_usage, texts_for(body)))
        finals = await _finals_unless_disconnected(engine, [request], http)
        if finals is None:
            return Response(status_code=_CLIENT_CLOSED)
        out = finals[0]
        return JSONResponse({**meta, "object": "chat.completion", "choices": [{
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(texts_for(body), c.logprobs) if c.logprobs is not None
            else None,
            "finish_reason": c.finish_reason} for c in out.outputs],
            "usage": _usage([out])})

    return app


async def _final(engine: AsyncLLMEngine, request: EngineRequest) -> RequestOutput:
    out = None
    async for out in engine.stream(request):  # noqa: B007 (only the last output matters)
        pass
    assert out is not None
    if out.error:
        status, code = _failure(out)
        raise _HTTPError(status, out.error, code=code)
    return out


def _failure(out: RequestOutput) -> tuple[int, str]:
    """The HTTP status and error code of a request that failed alone: too big for the KV
    cache is the client's to fix (400); any other failure was the server's (500), and the
    server serves the other requests on."""
    if out.failure is None or out.failure.stage == "kv_cache":
        return 400, "kv_cache_too_small"
    return 500, "request_failed"


async def _finals_unless_disconnected(engine: AsyncLLMEngine, requests: list[EngineRequest],
                                      http: Request) -> list[RequestOutput] | None:
    """The final outputs of ``requests``; None if the client went away first, in which case
    they have been aborted (their streams' cleanup tells the engine). Cancelled (by the
    server once its graceful-shutdown time is over), it aborts them and raises EngineError,
    answered with a 503 body rather than a traceback and a bare 500."""
    work = asyncio.ensure_future(asyncio.gather(*(_final(engine, r) for r in requests)))
    watch = asyncio.ensure_future(_client_gone(http))
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()
        raise EngineError("the server is shutting down; the request was aborted") from None
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # let the aborts go out
    return work.result() if work in done else None


async def _client_gone(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _without_generated(out: RequestOutput) -> RequestOutput:
    """``out`` without its generated tokens (echo with max_tokens 0 generates one to drop)."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(c, text="", token_ids=[], delta_text="", delta_token_ids=[],
                            logprobs=[], delta_logprobs=[]) for c in out.outputs])


def _prompt_text(out: RequestOutput, texts: TokenTexts) -> str:
    if out.prompt is not None:
        return out.prompt
    return "".join(texts(t) for t in out.prompt_token_ids)


def _completion_choice(index: int, out: RequestOutput, completion: CompletionOutput,
                       body: CompletionRequest, texts: TokenTexts) -> dict[str, Any]:
    prefix = _prompt_text(out, texts) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        ids, entries = list(completion.token_ids), list(completion.logprobs)
        if body.echo:
            ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
        logprobs = completion_logprobs(texts, ids, entries)
    return {"index": index, "text": prefix + completion.text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


async def _completion_chunks(engine: AsyncLLMEngine, request: EngineRequest, meta: dict,
                             body: CompletionRequest, texts: TokenTexts
                             ) -> AsyncIterator[dict[str, Any]]:
    def chunk(index: int, text: str, logprobs: dict | None,
              finish_reason: str | None) -> dict[str, Any]:
        return {**meta, "object": "text_completion", "choices": [{
            "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    last = None
    offsets: dict[int, int] = {}  # per sample, the text_offset of its next token
    done: set[int] = set()
    try:
        async for last in engine.stream(request):
            if last.error:
                status, code = _failure(last)
                yield error_body(last.error, status, code=code)
                return
            if body.echo_only:
                last = _without_generated(last)
            for delta in last.outputs:
                i = delta.index
                text, ids, entries = delta.delta_text, delta.delta_token_ids, \
                    delta.delta_logprobs
                if body.echo and i not in offsets:  # a sample's first chunk carries the prompt
                    text = _prompt_text(last, texts) + text
                    ids = last.prompt_token_ids + ids
                    entries = (last.prompt_logprobs or []) + (entries or [])
                with_logprobs = body.logprobs is not None and bool(ids)
                finishing = delta.finish_reason is not None and i not in done
                if text or with_logprobs or finishing:
                    offset = offsets.get(i, 0)
                    logprobs = completion_logprobs(texts, ids, entries, offset) \
                        if body.logprobs is not None else None
                    offsets[i] = offset + sum(len(texts(t)) for t in ids)
                    if finishing:
                        done.add(i)
                    yield chunk(i, text, logprobs, delta.finish_reason)
    except KvmemError as e:  # the engine failed or is shutting down
        yield _stream_error(e)
        return
    if body.include_usage and last is not None:
        yield {**meta, "object": "text_completion", "choices": [], "usage": _usage([last])}


async def _chat_chunks(engine: AsyncLLMEngine, request: EngineRequest, meta: dict,
                       include_usage: bool, texts: TokenTexts) -> AsyncIterator[dict[str, Any]]:
    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None,
              logprobs: dict | None = None) -> dict[str, Any]:
        return {**meta, "object": "chat.completion.chunk", "choices": [{
            "index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason}]}

    for i in range(request.sampling_params.n):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    last = None
    done: set[int] = set()
    try:
        async for last in engine.stream(request):
            if last.error:
                status, code = _failure(last)
                yield error_body(last.error, status, code=code)
                return
            for out in last.outputs:
                if out.delta_text or out.delta_logprobs:
                    logprobs = chat_logprobs(texts, out.delta_logprobs) \
                        if out.delta_logprobs is not None else None
                    yield chunk(out.index, {"content": out.delta_text}, None, logprobs)
                if out.finish_reason is not None and out.index not in done:
                    done.add(out.index)
                    yield chunk(out.index, {}, out.finish_reason)
    except KvmemError as e:  # the engine failed or is shutting down
        yield _stream_error(e)
        return
    if include_usage and last is not None:
        yield {**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage([last])}


def _stream_error(e: KvmemError) -> dict[str, Any]:
    """The last event of a stream the engine could not finish (the status it would have had)."""
    if isinstance(e, InvalidRequestError):
        return error_body(str(e), 400, e.param)
    return error_body(str(e), 503 if isinstance(e, EngineError) else 500)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(_HTTPError)
    async def http_error(_: Request, e: _HTTPError) -> JSONResponse:
        return error_response(str(e), e.status, e.param, e.code)

    @app.exception_handler(PromptTooLongError)
    async def prompt_too_long(_: Request, e: PromptTooLongError) -> JSONResponse:
        return error_response(str(e), 400, e.param, "context_length_exceeded")

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, e: InvalidRequestError) -> JSONResponse:
        return error_response(str(e), 400, e.param)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        return error_response(str(e), 503)

    @app.exception_handler(KvmemError)
    async def kvmem_error(_: Request, e: KvmemError) -> JSONResponse:
        return error_response(str(e), 400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(f"malformed JSON body: {first.get('msg', '')}", 400,
                                  code="invalid_json")
        param, in_union = field_path(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            return error_response(f"{param}: not a field kvmem serves (the fields are in "
                                  "/openapi.json)", 400, param)
        msg = str(first.get("msg", "bad body"))
        if in_union:  # pydantic reports one error per type the field accepts: name none
            msg = f"not one of the accepted types ({msg.lower()}, ...)"
        return error_response(f"{param}: {msg}" if param else msg, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(_: Request, e: StarletteHTTPException) -> JSONResponse:
        response = error_response(str(e.detail), e.status_code)
        response.headers.update(e.headers or {})  # e.g. a 405's Allow
        return response
