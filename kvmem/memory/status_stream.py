"""``GET /kvcache/status/stream``: an engine's ``/kvcache/status`` as Server-Sent Events,
sent again whenever it changes.

A control plane watching several engines would otherwise poll each one's status. The
stream sends the status at once (event ``status``), then again whenever something other
than its two ages (``idle_s`` and ``heartbeat_age_s``, which move at every read) differs
from the last one sent, looking every ``interval`` seconds (query ``?interval=``, 0.5 by
default, 0.05 to 60; ``?ipc_name=`` names another engine, as in the other routes). A
comment line every ``KEEPALIVE_S`` keeps proxies from closing a quiet stream. When the
engine leaves the ledger, an event ``gone`` carries the error and the stream ends; the
client may close it at any time. A server that shuts down calls ``end_all`` first (an
open stream would otherwise hold its graceful shutdown until the client leaves): each
stream then sends ``gone`` too, at once. Each look is one read of the ledger (about
0.1 ms), off the event loop. Torch-free.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

DEFAULT_INTERVAL_S = 0.5
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 60.0
KEEPALIVE_S = 15.0
_AGES = ("idle_s", "heartbeat_age_s")

Look = Callable[[], tuple[int, dict[str, Any]]]  # (HTTP status, document), blocking
Message = dict[str, Any]

_open: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()  # each stream's end


def end_all() -> None:
    """End every open stream now (its server is shutting down); from any thread, or a
    signal handler."""
    for loop, ending in list(_open):
        loop.call_soon_threadsafe(ending.set)


def parse_query(query: bytes) -> tuple[float, dict[str, Any]]:
    """The interval and the status body (``ipc_name``) a query asks for; ``ValueError``
    naming the field for anything else."""
    try:
        fields = parse_qs(query.decode("ascii"), keep_blank_values=True, strict_parsing=True,
                          errors="strict", max_num_fields=8) if query else {}
    except (UnicodeDecodeError, ValueError):
        raise ValueError("the query string is not name=value pairs") from None
    unknown = sorted(set(fields) - {"interval", "ipc_name"})
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of this route (interval, ipc_name)")
    for name, values in fields.items():
        if len(values) > 1:
            raise ValueError(f"{name}: given twice")
    interval = DEFAULT_INTERVAL_S
    if "interval" in fields:
        try:
            interval = float(fields["interval"][0])
        except ValueError:
            interval = math.nan
        if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
            raise ValueError(f"interval: expected seconds from {MIN_INTERVAL_S:g} to "
                             f"{MAX_INTERVAL_S:g}, got {fields['interval'][0]!r}")
    body = {"ipc_name": fields["ipc_name"][0]} if "ipc_name" in fields else {}
    return interval, body


def event(name: str, doc: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode()


def _without_ages(doc: dict[str, Any]) -> str:
    """The document as compared between looks: the engine's ages left out."""
    engine = {k: v for k, v in doc["kvmem"]["engine"].items() if k not in _AGES}
    doc = {**doc, "kvmem": {**doc["kvmem"], "engine": engine}}
    return json.dumps(doc, sort_keys=True)


async def serve(look: Look, first: dict[str, Any], interval: float,
                receive: Callable[[], Awaitable[Message]],
                send: Callable[[Message], Awaitable[None]]) -> None:
    """Stream ``first`` (the status just read), then each changed status ``look`` reads,
    until the client leaves, ``look`` answers other than 200, or ``end_all`` is called."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
    await send({"type": "http.response.body", "body": event("status", first),
                "more_body": True})
    loop = asyncio.get_running_loop()
    last, sent_at = _without_ages(first), loop.time()
    left = asyncio.ensure_future(_until_disconnect(receive))
    ending = asyncio.Event()
    ended = asyncio.ensure_future(ending.wait())
    _open.add((loop, ending))
    try:
        while True:
            await asyncio.wait({left, ended}, timeout=interval,
                               return_when=asyncio.FIRST_COMPLETED)
            if left.done():
                return  # the client went away: nothing more to send
            if ended.done():
                status, doc = 503, {"error": "the server is shutting down"}
            else:
                status, doc = await asyncio.to_thread(look)
            if status != 200:
                await send({"type": "http.response.body", "body": event("gone", doc),
                            "more_body": False})
                return
            now, key = loop.time(), _without_ages(doc)
            if key != last:
                chunk = event("status", doc)
            elif now - sent_at >= KEEPALIVE_S:
                chunk = b": keepalive\n\n"
            else:
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            last, sent_at = key, now
    finally:
        _open.discard((loop, ending))
        left.cancel()
        ended.cancel()


async def _until_disconnect(receive: Callable[[], Awaitable[Message]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
