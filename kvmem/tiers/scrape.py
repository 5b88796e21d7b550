"""Reading a server's ``/metrics`` page over HTTP, bounded however the server answers.

One deadline covers the whole answer (connection, headers, body and redirects): a server
that trickles its answer a byte at a time never lets a per-read timeout fire, so a timer
shuts the connection down when the deadline passes. At most ``MAX_PAGE_BYTES`` are read;
only ``http``/``https`` URLs are used, redirects are followed ``MAX_REDIRECTS`` times at
most, and only to ``http``/``https``; an answer must be plain text (Prometheus' or
OpenMetrics' text format), not compressed. Every failure is a one-line ``KvmemError``
naming the URL, with whatever the server sent shown escaped and cut short (``shown``).
Standard library only.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass

from kvmem.errors import KvmemError
from kvmem.units import format_bytes

MAX_PAGE_BYTES = 16 << 20  # a vLLM page is some 100 KiB
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
PAGE_TYPES = ("text/plain", "application/openmetrics-text")
ACCEPT = "text/plain;version=0.0.4"  # prometheus_client answers OpenMetrics if named at all
# a URL may not hold these (http.client refuses them mid-request)
_UNSAFE = frozenset(map(chr, [*range(0x21), 0x7F]))
_KEEP = "/%:@!$&'()*+,;=-._~"  # left as they are when percent-encoding a path


def shown(text: str, limit: int = 80) -> str:
    """``text`` from elsewhere, for a message or a table: characters that are not
    printable escaped (no terminal escape sequence gets through), at most ``limit``
    characters."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit + 1])
    return out if len(out) <= limit else out[:limit - 3] + "..."


def _quoted(url: str) -> str:
    return shown(repr(url), 200)


def _usable(url: str) -> str:
    """An http(s) URL this module can request, with other than ASCII in its path and query
    percent-encoded; a one-line error when it is not one."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError as exc:
        raise KvmemError(f"not a usable URL: {_quoted(url)} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KvmemError(f"not an http(s) URL: {_quoted(url)}")
    if not parts.hostname.isascii():
        raise KvmemError(f"not a usable URL: {_quoted(url)} (write the host name in ASCII)")
    if _UNSAFE & set(url):
        raise KvmemError(f"not a usable URL: {_quoted(url)} (spaces and control characters "
                         "must be percent-encoded)")
    return urllib.parse.urlunsplit(parts._replace(
        path=urllib.parse.quote(parts.path, safe=_KEEP),
        query=urllib.parse.quote(parts.query, safe=_KEEP + "?")))


def metrics_url(url: str) -> str:
    """``url`` as given (see ``_usable``), or with ``/metrics`` when it names only a
    server."""
    parts = urllib.parse.urlsplit(_usable(url))
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def _redirect(url: str, current: str, location: str) -> str:
    """Where a redirect from ``current`` leads, when this module can follow it."""
    try:
        return _usable(urllib.parse.urljoin(current, location.strip()))
    except (KvmemError, ValueError) as exc:
        raise KvmemError(f"cannot read {url}: it redirects to {shown(location)}, which is "
                         f"not followed ({shown(str(exc), 120)})") from None


@dataclass
class _Answer:
    status: int
    reason: str
    headers: http.client.HTTPMessage
    body: bytes


class _Deadline:
    """Shuts a connection down at the deadline, waking a read blocked on it."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn = conn
        self.expired = False
        self._timer = threading.Timer(max(0.0, seconds), self._cut)
        self._timer.daemon = True

    def _cut(self) -> None:
        self.expired = True
        sock = self.conn.sock
        if sock is not None:
            # the plain socket's shutdown: TLS state is left to the reading thread
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _get(url: str, deadline: float) -> _Answer:
    """One GET of ``url`` (a ``_usable`` one; no redirect followed), done by ``deadline``."""
    parts = urllib.parse.urlsplit(url)
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    https = parts.scheme == "https"
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    # the port always given: http.client would read "::1" as host "::", port 1
    conn = kind(parts.hostname, parts.port or (443 if https else 80), timeout=left)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        with _Deadline(conn, left) as timer:
            try:
                conn.connect()
                if timer.expired:  # before the socket was there to shut down
                    raise TimeoutError
                conn.request("GET", target, headers={"Accept": ACCEPT, "User-Agent": "kvmem"})
                response = conn.getresponse()
                body = response.read(MAX_PAGE_BYTES + 1)
                if response.length and len(body) <= MAX_PAGE_BYTES:  # read(n) does not check
                    raise http.client.IncompleteRead(body, response.length)
            except (OSError, http.client.HTTPException):
                if timer.expired:
                    raise TimeoutError from None
                raise
            if timer.expired:  # a body read to the connection's end may have been cut
                raise TimeoutError
    finally:
        conn.close()
    return _Answer(response.status, response.reason, response.headers, body)


def _refusal(answer: _Answer) -> str | None:
    """Why a final answer is not a page to parse, if it is not."""
    if answer.status != 200:
        return f"{answer.status} {shown(answer.reason)}".rstrip()
    if len(answer.body) > MAX_PAGE_BYTES:
        return f"the page is larger than {format_bytes(MAX_PAGE_BYTES)}"
    encoding = answer.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        return f"the page is {shown(encoding)}-encoded, though asked for plain text"
    content_type = answer.headers.get_content_type() \
        if answer.headers.get("Content-Type") else "text/plain"
    if content_type not in PAGE_TYPES:
        return f"the answer is {shown(content_type)}, not a metrics page"
    return None


def _reason(exc: OSError | http.client.HTTPException) -> str:
    if isinstance(exc, http.client.IncompleteRead):
        return "the answer ended early"
    if isinstance(exc, OSError):  # RemoteDisconnected too
        return shown(exc.strerror or str(exc) or type(exc).__name__, 200)
    return f"not an HTTP answer ({type(exc).__name__}: {shown(str(exc), 60)})"


def scrape(url: str, timeout_s: float) -> str:
    """The text of a ``/metrics`` page, within ``timeout_s`` in all; a one-line
    ``KvmemError`` when it cannot be read."""
    url = metrics_url(url)
    deadline = time.monotonic() + timeout_s
    target = url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            answer = _get(target, deadline)
            location = answer.headers.get("Location")
            if answer.status not in REDIRECTS or location is None:
                break
            target = _redirect(url, target, location)
        else:
            raise KvmemError(f"cannot read {url}: more than {MAX_REDIRECTS} redirects")
    except TimeoutError:
        raise KvmemError(f"cannot read {url}: no complete answer within {timeout_s:g} s") \
            from None
    except (OSError, http.client.HTTPException) as exc:
        raise KvmemError(f"cannot read {url}: {_reason(exc)}") from None
    refusal = _refusal(answer)
    if refusal is not None:
        raise KvmemError(f"cannot read {url}: {refusal}")
    return answer.body.decode("utf-8", errors="replace")
