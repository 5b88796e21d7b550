"""The page and its JSON API on one port, served by the standard library.

``GET /`` the page, ``/static/NAME`` its script and style (shipped in this package: the
page fetches nothing from elsewhere, and its Content-Security-Policy says so to the
browser), ``/api/plan?QUERY`` `kvmem plan --json`'s document for the flags in the query
(``kvmem.ui.query``), ``/api/view?QUERY`` the same document with what the page draws
(``kvmem.ui.view``), ``/api/form`` the flags the page offers. A refused query is a 400
with ``{"error": the CLI's line, "field": the flag it names}``.

``http.server``'s ``ThreadingHTTPServer`` keeps `kvmem ui` free of dependencies beyond
the planner's own. Its links are shared, so every request is untrusted: the plans are
computed in worker processes against a deadline (``kvmem.ui.workers``); a request's line
and headers must arrive within a few seconds and a bounded size, as must the next request
on a kept-alive connection; at most ``limits.MAX_CONNECTIONS`` connections are served at
once (one thread each), the next is answered 503; a client that goes away is not an error.
HEAD is answered as GET without the body, OPTIONS with the methods taken; every error,
http.server's own included, is one line of JSON.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import socket
import sys
import threading
import time
from functools import cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import urlsplit

from kvmem.ui import limits
from kvmem.ui.query import form
from kvmem.ui.workers import Busy, PlanWorkers

_STATIC = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
_SECURITY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_PLANS = {"/api/plan": "plan", "/api/view": "view"}  # computed by the workers
_ALLOW = "GET, HEAD, OPTIONS"


@cache
def _asset(name: str) -> bytes:
    return resources.files("kvmem.ui").joinpath("static", name).read_bytes()


@cache
def _form() -> bytes:
    return json.dumps(form()).encode()


def _error(message: str, field: str | None = None) -> bytes:
    return json.dumps({"error": message, "field": field}).encode()


class _Oversized(ConnectionError):
    """A request's line and headers ran past ``limits.MAX_HEAD_BYTES``: the connection is
    closed unanswered, as a client that sends that much is not a browser."""


class _HeadReader(io.RawIOBase):
    """A connection's bytes for http.server's parser, read against a deadline and a byte
    budget that ``next_request`` renews: a socket timeout alone lets a client that sends a
    byte a second hold its thread for ever."""

    def __init__(self, sock: socket.socket, seconds: float, budget: int):
        self._sock, self._seconds, self._budget = sock, seconds, budget
        self.next_request()

    def next_request(self) -> None:
        self._deadline = time.monotonic() + self._seconds
        self._left = self._budget

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        if self._left <= 0:
            raise _Oversized("request head too large")
        self._sock.settimeout(remaining)
        n = self._sock.recv_into(memoryview(buffer)[:self._left])
        self._left -= n
        return n


class Handler(BaseHTTPRequestHandler):
    server_version = "kvmem-ui"
    protocol_version = "HTTP/1.1"
    server: UIServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by the reader with a deadline
        self._head = _HeadReader(self.connection, self.server.request_seconds,
                                 limits.MAX_HEAD_BYTES)
        self.rfile = io.BufferedReader(self._head)

    def handle_one_request(self) -> None:
        self._head.next_request()
        super().handle_one_request()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.headers.get("Content-Length", "0").strip() not in ("", "0") or \
                "Transfer-Encoding" in self.headers:
            self.close_connection = True  # a body is never read: it cannot be the next request
        url = urlsplit(self.path)
        path = "/static/index.html" if url.path in ("/", "/index.html") else url.path
        if path.startswith("/static/") and path[len("/static/"):] in _STATIC:
            name = path[len("/static/"):]
            self._send(HTTPStatus.OK, _asset(name), f"{_STATIC[name]}; charset=utf-8")
        elif path == "/api/form":
            self._send(HTTPStatus.OK, _form(), "application/json")
        elif path in _PLANS:
            self._plan(_PLANS[path], url.query)
        else:
            self._json(HTTPStatus.NOT_FOUND, _error(f"no such page: {url.path}"))

    do_HEAD = do_GET  # noqa: N815 (http.server's name): _send leaves out the body

    def do_OPTIONS(self) -> None:  # noqa: N802 (http.server's name)
        self._send(HTTPStatus.NO_CONTENT, b"", None)

    def _get_only(self) -> None:
        self.close_connection = True  # its body, if any, is not read
        self._json(HTTPStatus.METHOD_NOT_ALLOWED,
                   _error(f"{self.command} is not answered here: the page and its API take "
                          "GET (and HEAD, OPTIONS)"))

    do_POST = do_PUT = do_PATCH = do_DELETE = _get_only  # noqa: N815 (http.server's names)

    def _plan(self, endpoint: str, query: str) -> None:
        try:
            outcome, value = self.server.workers.ask(endpoint, query)
        except Busy:
            self._json(HTTPStatus.SERVICE_UNAVAILABLE,
                       _error("the planner is busy with other plans; try again"))
            return
        if outcome == "ok":
            self._json(HTTPStatus.OK, json.dumps(value).encode())
        elif outcome == "refused":
            self._json(HTTPStatus.BAD_REQUEST, _error(*value))
        else:
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, _error(value))

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """http.server's own refusals (a malformed or oversized request, an unknown
        method), as one line of JSON like every other."""
        status = HTTPStatus(code)
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        if status == HTTPStatus.REQUEST_URI_TOO_LONG:
            message = (f"the request line is longer than {limits.MAX_REQUEST_LINE:,} bytes, "
                       "the most the page takes")
        self._json(status, _error(message or status.phrase))

    def _json(self, status: HTTPStatus, body: bytes) -> None:
        self._send(status, body, "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str | None) -> None:
        self.connection.settimeout(self.server.request_seconds)  # a client that reads nothing
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        if status in (HTTPStatus.METHOD_NOT_ALLOWED, HTTPStatus.NO_CONTENT):
            self.send_header("Allow", _ALLOW)
        if self.close_connection:
            self.send_header("Connection", "close")
        for name, value in _SECURITY.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        if self.server.verbose:
            super().log_message(format, *args)


def _busy_answer() -> bytes:
    body = _error(f"kvmem ui is serving {limits.MAX_CONNECTIONS} connections, its most; "
                  "try again")
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class UIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, verbose: bool = False,
                 request_seconds: float = limits.REQUEST_SECONDS,
                 max_connections: int = limits.MAX_CONNECTIONS,
                 workers: PlanWorkers | None = None):
        self.verbose = verbose
        self.request_seconds = request_seconds
        self._slots = threading.BoundedSemaphore(max_connections)
        self.workers = workers
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)  # binds first: a port in use starts no worker
        if self.workers is None:
            self.workers = PlanWorkers()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._turn_away(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _turn_away(self, request: socket.socket) -> None:
        """One over the limit: a 503 without a thread, then the connection is closed."""
        try:
            request.setblocking(False)
            with contextlib.suppress(BlockingIOError):  # read what has arrived, so that
                request.recv(limits.MAX_HEAD_BYTES)     # closing sends the answer, not a reset
            request.settimeout(1.0)
            request.sendall(_busy_answer())
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up, resets, stalls or oversends is no server error, nor is
        a connection closed under its thread as the process exits: one line with
        --verbose, else nothing."""
        error = sys.exc_info()[1]
        gone = isinstance(error, OSError) and error.errno in (errno.EBADF, errno.ENOTCONN)
        if gone or isinstance(error, (ConnectionError, TimeoutError)):
            if self.verbose:
                print(f"kvmem ui: {client_address[0]}: {type(error).__name__}: {error}",
                      file=sys.stderr)
            return
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        if self.workers is not None:
            self.workers.close()
