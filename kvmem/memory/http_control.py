"""Elastic KV memory steered over HTTP on an engine's own port, as control planes steer kvcached.

``KVCacheControl`` answers kvcached's five routes for one engine in the ledger (and,
with ``ipc_name``, for any other engine on the host), with kvcached's paths, fields and
meanings, so a controller written for kvcached drives kvmem too, and one of kvmem's own:

- ``GET /kvcache/status``: the engine's use (kvcached's ``segments``) and kvmem's own view
  (floor, ceiling, mapped, live, cached, reclaims), as ``kvmem top --json`` shows it;
- ``POST /kvcache/limit``: its ceiling, ``{"size": "3G"}`` or ``{"size_bytes": N}``
  (``"none"`` removes it; ``floor``/``floor_bytes`` set the floor, as ``kvmem limit --min``);
- ``POST /kvcache/limit_percent``: the ceiling as a share of the device's memory;
- ``POST /kvcache/trim``: the ceiling down to what running requests hold (or ``target``),
  so the engine gives back its free pages and its prefix cache;
- ``GET /kvcache/safety_floor``: the least ceiling, one request of its max_model_len;
- ``GET /kvcache/status/stream``: the status as Server-Sent Events, again at each change
  (kvmem's own; ``kvmem.memory.status_stream``).

A ceiling below the safety floor is raised to it (``clamped``): an engine under it could
never run a request, so ``force`` cannot go lower. The engine applies a change at its next
heartbeat, as for ``kvmem limit``. ``KVCacheControlMiddleware`` serves the routes in
front of any ASGI app: ``kvmem serve`` puts it behind its API key, and kvmem's vLLM
integration loads it through vLLM's ``--middleware``. Torch-free.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.memory import control, status_stream
from kvmem.memory.ledger import LedgerError, UnknownEngineError, check_engine_name
from kvmem.units import MAX_BYTES, format_bytes, parse_size

PREFIX = "/kvcache/"
STREAM_PATH = PREFIX + "status/stream"
MAX_BODY = 4096  # the largest request these routes take is well under 200 bytes
BODY_TIMEOUT_S = 10.0  # a body still not whole by then (a chunked one never ended): 408
_BINARY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt])\s*$", re.IGNORECASE)


class ControlError(Exception):
    """A request the routes refuse: its status and one line naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _human(doc: dict[str, Any]) -> dict[str, Any]:
    """Each byte field also as text, under ``<field>_human`` (kvcached's convention)."""
    out = dict(doc)
    for key, value in doc.items():
        if isinstance(value, int) and not isinstance(value, bool) and _is_bytes(key):
            out[f"{key}_human"] = format_bytes(value)
    return out


def _is_bytes(key: str) -> bool:
    return key.endswith(("_size", "_limit", "_floor", "_memory", "_occupied", "_minimum",
                         "_estimate", "_total", "_used", "_prealloc")) or key == "new_limit"


def parse_request_size(value: object, field: str) -> int | None:
    """A size as kvcached takes it (``"3G"`` is 3 GiB; K, M, G and T are binary) or as
    kvmem writes it (``"3GiB"``, ``"3e9"``, a number of bytes); ``"none"``/null: no limit."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none",
                                                                               "unlimited")):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ControlError(400, f"{field}: expected a size such as \"3G\" or a number of "
                                f"bytes, got {type(value).__name__}")
    if isinstance(value, str) and (m := _BINARY.match(value)):
        value = float(m[1]) * 1024 ** ("kmgt".index(m[2].lower()) + 1)
    try:
        return parse_size(value, field)
    except ConfigError as e:
        raise ControlError(400, str(e)) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (which of two sizes was meant?)."""
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise ControlError(400, f"{key}: given twice")
        body[key] = value
    return body


def _bool(body: dict[str, Any], field: str) -> bool:
    value = body.get(field, False)
    if not isinstance(value, bool):
        raise ControlError(400, f"{field}: expected true or false")
    return value


def device_memory(device: str) -> int | None:
    """The device's memory: the host's for ``cpu``; a CUDA device's from torch, only where
    torch has already been imported (the engine's process; never a new CUDA context)."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(int(device.partition(":")[2] or 0))
               .total_memory)


class KVCacheControl:
    """The routes for engine ``name`` (a callable: resolved at the first request, where the
    name is known only then) on the ledgers in ``ledger_dir``."""

    def __init__(self, name: str | Callable[[], str], *, ledger_dir: str | Path | None = None,
                 reserved_bytes: int | None = None) -> None:
        self._name = name
        self._ledger_dir = ledger_dir
        self._reserved = reserved_bytes  # the engine's whole KV range, where known

    @property
    def name(self) -> str:
        if callable(self._name):
            self._name = self._name()
        return self._name

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """(status, JSON document) for one request; every refusal is a 4xx with ``error``."""
        routes = {"status": ("GET", self.status), "safety_floor": ("GET", self.safety_floor),
                  "limit": ("POST", self.limit), "limit_percent": ("POST", self.limit_percent),
                  "trim": ("POST", self.trim)}
        route = routes.get(path.removeprefix(PREFIX))
        if route is None:
            return 404, {"error": f"no route {path}; the routes are "
                                  + ", ".join([PREFIX + r for r in routes] + [STREAM_PATH])}
        want, fn = route
        if method != want and not (want == "GET" and method == "HEAD"):
            return 405, {"error": f"{path} takes {want}"}
        try:
            parsed = self._body(body) if want == "POST" else {}
        except ControlError as e:
            return e.status, {"error": str(e)}
        return self.run(fn, parsed)

    @staticmethod
    def run(fn: Callable[[dict[str, Any]], dict[str, Any]],
            body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``fn(body)`` as (status, JSON document); every refusal a 4xx with ``error``."""
        try:
            return 200, fn(body)
        except ControlError as e:
            return e.status, {"error": str(e)}
        except UnknownEngineError as e:
            return 404, {"error": str(e)}
        except (ConfigError, LedgerError) as e:  # refused by the ledger's own rules
            return 409, {"error": str(e)}

    @staticmethod
    def _body(raw: bytes) -> dict[str, Any]:
        if not raw.strip():
            return {}
        if len(raw) > MAX_BODY:
            raise ControlError(413, f"the body is over {MAX_BODY} bytes")
        try:
            body = json.loads(raw, object_pairs_hook=_unique_keys)
        except ControlError:
            raise
        except (ValueError, RecursionError):
            raise ControlError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ControlError(400, "the body must be a JSON object")
        return body

    # ------------------------------------------------------------------ the engine
    def _engine(self, body: dict[str, Any]) -> tuple[control.DeviceView, control.EngineView]:
        name = body.get("ipc_name", self.name)
        if not isinstance(name, str):
            raise ControlError(400, "ipc_name: expected an engine name (see kvmem top)")
        try:
            check_engine_name(name)
        except ConfigError as e:
            raise ControlError(400, f"ipc_name: {e}") from None
        for view in control.devices(self._ledger_dir):
            for engine in view.engines:
                if engine.name == name:
                    return view, engine
        raise ControlError(404, f"ipc_name: no running engine named {name!r} (see kvmem top)")

    def _segment(self, view: control.DeviceView, e: control.EngineView) -> dict[str, Any]:
        used = e.live_bytes + e.cached_bytes
        prealloc = max(0, e.mapped_bytes - used)
        total = self._total(view, e)
        floor = self._floor(e)
        return _human({
            "ipc_name": e.name, "total_size": total, "used_size": used,
            "prealloc_size": prealloc, "free_size": max(0, total - used - prealloc),
            "usage_percent": round(100 * used / total, 1) if total else 0.0,
            "physical_occupied": e.mapped_bytes, "min_effective_limit": used,
            "min_safe_limit": floor, "safety_floor": floor})

    def _total(self, view: control.DeviceView, e: control.EngineView) -> int:
        """The most it may hold now: its ceiling and the device total, else its KV range."""
        for candidate in (e.allowed_bytes, self._reserved if e.name == self.name else None,
                          view.total_bytes):
            if candidate is not None:
                return candidate
        return e.mapped_bytes

    @staticmethod
    def _floor(e: control.EngineView) -> int:
        return max(e.request_bytes or 0, e.floor_bytes)

    def status(self, body: dict[str, Any]) -> dict[str, Any]:
        view, engine = self._engine(body)
        memory = device_memory(view.device)
        device = {k: v for k, v in asdict(view).items() if k != "engines"}
        return {"self_ipc_name": self.name, "segments": [self._segment(view, engine)],
                **(_human({"gpu_total_memory": memory}) if memory is not None else {}),
                "kvmem": {"version": control.DOCUMENT_VERSION, "device": device,
                          "engine": asdict(engine)}}

    def safety_floor(self, body: dict[str, Any]) -> dict[str, Any]:
        _, e = self._engine(body)
        floor = self._floor(e)
        return {**_human({"safety_floor": floor, "model_min_safe_limit": e.request_bytes or 0,
                          "hard_minimum": floor}),
                "description": "the least ceiling: one request of the engine's max_model_len "
                               "(and its floor); a lower limit is raised to it, force or not"}

    # ------------------------------------------------------------------ changes
    def limit(self, body: dict[str, Any]) -> dict[str, Any]:
        given = [f for f in ("size", "size_bytes") if f in body]
        floor_given = [f for f in ("floor", "floor_bytes") if f in body]
        if len(given) > 1 or len(floor_given) > 1:
            raise ControlError(400, "give size or size_bytes (and floor or floor_bytes) once")
        if not given and not floor_given:
            raise ControlError(400, "size: give size (e.g. \"3G\") or size_bytes")
        ceiling = parse_request_size(body[given[0]], given[0]) if given else "keep"
        floor = (parse_request_size(body[floor_given[0]], floor_given[0]) or 0
                 if floor_given else None)
        return self._set(body, ceiling, floor)

    def limit_percent(self, body: dict[str, Any]) -> dict[str, Any]:
        percent = body.get("percent")
        if isinstance(percent, bool) or not isinstance(percent, (int, float)) \
                or not 0 < percent <= 100:
            raise ControlError(400, "percent: expected a number above 0 and at most 100")
        view, _ = self._engine(body)
        memory = device_memory(view.device)
        if memory is None:
            raise ControlError(409, f"percent: the memory of {view.device} is not known in "
                                    "this process; give size instead")
        result = self._set(body, max(1, int(memory * percent / 100)), None)
        return {**result, **_human({"gpu_total_memory": memory}), "percent": percent}

    def trim(self, body: dict[str, Any]) -> dict[str, Any]:
        given = [f for f in ("target", "target_bytes") if f in body]
        if len(given) > 1:
            raise ControlError(400, "give target or target_bytes once")
        view, e = self._engine(body)
        target = (parse_request_size(body[given[0]], given[0]) if given and body[given[0]]
                  not in (0, "0") else None)
        result = self._set(body, e.live_bytes if target is None else target, None)
        freed = max(0, e.mapped_bytes - result["new_total_size"])
        return {**result, **_human({"previous_used": e.live_bytes + e.cached_bytes,
                                    "previous_prealloc": max(0, e.mapped_bytes - e.live_bytes
                                                             - e.cached_bytes),
                                    "new_limit": result["new_total_size"],
                                    "freed_estimate": freed})}

    def _set(self, body: dict[str, Any], ceiling: int | None | str,
             floor: int | None) -> dict[str, Any]:
        view, e = self._engine(body)
        _bool(body, "force")  # accepted for kvcached's clients; the safety floor holds anyway
        least = self._floor(e) if floor is None else max(e.request_bytes or 0, floor)
        clamped = isinstance(ceiling, int) and ceiling < least
        if clamped:
            ceiling = min(least, MAX_BYTES)
        previous = self._total(view, e)
        control.set_limits(e.name, floor_bytes=floor, ceiling_bytes=ceiling,
                           device=view.device, ledger_dir=self._ledger_dir)
        view, after = self._engine(body)
        new = self._total(view, after)
        used = after.live_bytes + after.cached_bytes
        return {"ipc_name": e.name, "success": True,
                **_human({"previous_total_size": previous, "new_total_size": new,
                          "current_used_size": used, "safety_floor": self._floor(after)}),
                "immediate_reclaim": new >= used, "clamped": clamped,
                "message": f"limit {format_bytes(previous)} -> {format_bytes(new)}; the "
                           "engine applies it at its next heartbeat"
                           + ("" if new >= used else ", giving back cached blocks, then "
                              "preempting, until it is under it")}


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class KVCacheControlMiddleware:
    """Answers ``/kvcache/*`` with ``control`` and passes everything else to ``app``.

    ``api_keys``: bearer tokens of which a request must carry one (None or empty: open;
    a callable is asked at the first request). Bodies over ``MAX_BODY`` get 413 unread,
    and bodies not whole within ``BODY_TIMEOUT_S`` get 408."""

    def __init__(self, app: ASGIApp, control: KVCacheControl,
                 api_keys: Iterable[str] | Callable[[Scope], Iterable[str]] | None = None
                 ) -> None:
        self.app = app
        self.control = control
        self._keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _reply(send, 401, {"error": "invalid or missing API key (send "
                                              "'Authorization: Bearer KEY')"}, scope)
            return
        if scope["path"] == STREAM_PATH:
            await self._stream(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(_read_body(receive), BODY_TIMEOUT_S)
        except TimeoutError:
            await _reply(send, 408, {"error": f"the body did not arrive whole within "
                                              f"{BODY_TIMEOUT_S:g} s"}, scope)
            return
        if body is None:
            await _reply(send, 413, {"error": f"the body is over {MAX_BODY} bytes"}, scope)
            return
        # the ledger is a small local file under a bounded lock: off the event loop anyway
        status, doc = await asyncio.to_thread(self.control.handle, scope["method"],
                                              scope["path"], body)
        await _reply(send, status, doc, scope)

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /kvcache/status/stream`` (``kvmem.memory.status_stream``)."""
        if scope["method"] != "GET":
            await _reply(send, 405, {"error": f"{STREAM_PATH} takes GET"}, scope)
            return
        try:
            interval, body = status_stream.parse_query(scope.get("query_string", b""))
        except ValueError as e:
            await _reply(send, 400, {"error": str(e)}, scope)
            return
        look = functools.partial(self.control.run, self.control.status, body)
        status, doc = await asyncio.to_thread(look)
        if status != 200:
            await _reply(send, status, doc, scope)
            return
        await status_stream.serve(look, doc, interval, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        keys = self._keys(scope) if callable(self._keys) else self._keys
        keys = [k.encode() for k in keys or () if k]
        if not keys:
            return True
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        return any(secrets.compare_digest(token, k) for k in keys)


async def _read_body(receive: Receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: Send, status: int, doc: dict[str, Any], scope: Scope) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body",
                "body": b"" if scope.get("method") == "HEAD" else body})
