"""The page and its JSON API on one port, served by the standard library.

``GET /`` the page, ``/static/NAME`` its script and style (shipped in this package: the
page fetches nothing from elsewhere, and its Content-Security-Policy says so to the
browser), ``/api/plan?QUERY`` `kvmem plan --json`'s document for the flags in the query
(``kvmem.ui.query``), ``/api/view?QUERY`` the same document with what the page draws
(``kvmem.ui.view``), ``/api/form`` the flags the page offers. A refused query is a 400
with ``{"error": the CLI's line, "field": the flag it names}``.

``http.server``'s ``ThreadingHTTPServer`` keeps `kvmem ui` free of dependencies beyond
the planner's own: one request is a plan of a few milliseconds, for one person's browser.
"""

from __future__ import annotations

import json
import socket
import sys
import traceback
from functools import cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import urlsplit

from kvmem.ui.query import QueryError, form, run_query
from kvmem.ui.view import page_view

_STATIC = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
_SECURITY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@cache
def _asset(name: str) -> bytes:
    return resources.files("kvmem.ui").joinpath("static", name).read_bytes()


def _plan(query: str) -> dict:
    return run_query(query)[1].document()


def _view(query: str) -> dict:
    args, run = run_query(query)
    return page_view(run, args.device)


_API = {"/api/plan": _plan, "/api/view": _view, "/api/form": lambda _query: form()}


class Handler(BaseHTTPRequestHandler):
    server_version = "kvmem-ui"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        path = "/static/index.html" if url.path in ("/", "/index.html") else url.path
        if path.startswith("/static/") and path[len("/static/"):] in _STATIC:
            name = path[len("/static/"):]
            self._send(HTTPStatus.OK, _asset(name), f"{_STATIC[name]}; charset=utf-8")
        elif path in _API:
            self._api(_API[path], url.query)
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}"})

    def _get_only(self) -> None:
        self.close_connection = True  # its body, if any, is not read
        self._json(HTTPStatus.METHOD_NOT_ALLOWED,
                   {"error": f"{self.command} is not answered here: the page and its API "
                             "take GET", "field": None})

    do_POST = do_PUT = do_PATCH = do_DELETE = _get_only  # noqa: N815 (http.server's names)

    def _api(self, handler, query: str) -> None:
        try:
            self._json(HTTPStatus.OK, handler(query))
        except QueryError as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e), "field": e.field})
        except Exception as e:  # a planner bug: one line to the page, the trace to the log
            traceback.print_exc(file=sys.stderr)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR,
                       {"error": f"internal error: {type(e).__name__}: {e}", "field": None})

    def _json(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", "GET")
        for name, value in _SECURITY.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        if self.server.verbose:
            super().log_message(format, *args)


class UIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, verbose: bool = False):
        self.verbose = verbose
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
