"""ASGI middleware that answers before the app reads a request: the API key and the body limit.

Both run ahead of routing and body parsing, so an unauthenticated request gets 401 whatever
its body holds, and an oversized body gets 413 without being parsed or tokenized; a body
that has not arrived whole within its time limit gets 408 (a client trickling bytes cannot
hold a connection open for ever). They are plain ASGI callables (not BaseHTTPMiddleware),
so streamed responses pass straight through.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from kvmem.serve.protocol import error_response

# The body limit unless the server is told otherwise: room for a 1M-token prompt as JSON
# (token ids, or text with every character \u-escaped), far below what would hurt the server.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# How long a request's body may take to arrive: 16 MiB at about 2 Mbit/s.
DEFAULT_BODY_TIMEOUT_S = 60.0

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on every HTTP route but ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                  401, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        return secrets.compare_digest(token, self._key)


class BodyLimitMiddleware:
    """Reads a request's body up to ``max_bytes`` and answers 413 beyond that, or 408 when
    it has not all arrived ``timeout_s`` after the request began.

    A declared Content-Length over the limit is refused before any byte is read; a
    chunked body is counted as it arrives. A body within the limit is handed to the app
    as one message, and later ``receive`` calls (disconnect polling) go to the server.
    """

    def __init__(self, app: ASGIApp, max_bytes: int,
                 timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(
                    receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:  # not the builtin TimeoutError before 3.11
                await self._too_slow(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body: bytes | None = b"".join(chunks)

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _refuse(scope, receive, send, 408, "request_timeout",
                      f"the request body did not arrive within {self.timeout_s:g} s")

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _refuse(scope, receive, send, 413, "request_too_large",
                      f"the request body is larger than this server's limit of "
                      f"{self.max_bytes} bytes")


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, code: str,
                  message: str) -> None:
    """Answer with an error and close the connection: the rest of the body is not read."""
    response = error_response(message, status, code=code)
    response.headers["Connection"] = "close"
    await response(scope, receive, send)
