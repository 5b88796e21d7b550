"""A time limit for a request's head (its request line and headers), which uvicorn reads
without one.

uvicorn's ``timeout_keep_alive`` bounds only the idle time after a response; a client that
opens a connection and sends its head a byte at a time holds the connection for ever, and
the body's time limit (``middleware.BodyLimitMiddleware``) starts only once the head is
complete. ``head_timeout_protocol`` is uvicorn's h11 protocol with a deadline: when a
connection opens, and after each response, the next request's head must be complete within
the limit, else the server answers 408 and closes the connection.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvmem.serve.protocol import error_body


def _refusal(timeout_s: float) -> bytes:
    body = json.dumps(error_body(f"the request head did not arrive within {timeout_s:g} s",
                                 408, code="request_timeout"), separators=(",", ":")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


def head_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose next request head is not
    complete ``timeout_s`` after the connection opened or the last response ended."""
    refusal = _refusal(timeout_s)

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_too_slow)

        def _head_too_slow(self) -> None:
            # IDLE: h11 has no complete request head from this client yet
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(refusal)
                self.transport.close()

    return HeadTimeoutProtocol
