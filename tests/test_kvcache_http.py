"""``/kvcache/*`` on ``kvmem serve``'s own port: kvcached's routes over kvmem's ledger.

An elastic engine behind an API key, driven in-process: status in kvcached's fields and
kvmem's, a limit in kvcached's sizes and in percent, a trim that the engine applies (its
mapped memory falls to the new ceiling), the safety floor that clamps a limit, another
engine named with ``ipc_name``, and every bad request a 4xx naming its field while the
engine keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from tiny_models import make_tiny_checkpoint

from kvmem.engine.async_engine import AsyncLLMEngine
from kvmem.engine.config import EngineConfig
from kvmem.engine.llm_engine import LLMEngine
from kvmem.memory import Ledger, http_control
from kvmem.memory.http_control import KVCacheControl, parse_request_size
from kvmem.serve import create_app

KEY = {"Authorization": "Bearer s3cret"}
MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kvcache-http"), "llama",
                                num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2)


@pytest.fixture()
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_LEDGER_DIR", str(tmp_path / "ledger"))
    return tmp_path / "ledger"


def app_for(tiny, **config) -> object:
    return create_app(AsyncLLMEngine(engine_for(tiny, **config)), api_key="s3cret")


def engine_for(tiny, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny), served_model_name="tiny", max_model_len=128,
                                  max_num_batched_tokens=32, **config))


def entry(ledger_dir, name="ctl"):
    [e] = [e for e in Ledger.for_device("cpu", ledger_dir).entries() if e.name == name]
    return e


def complete(http, prompt) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reply = http.post("/v1/completions", json=body, headers=KEY)
    assert reply.status_code == 200, reply.text


def test_kvcached_sizes_are_binary_and_kvmems_are_kept():
    assert parse_request_size("3G", "size") == 3 << 30
    assert parse_request_size("1.5g", "size") == 3 << 29
    assert parse_request_size("512M", "size") == 512 * MIB
    assert parse_request_size("3GiB", "size") == 3 << 30
    assert parse_request_size("3GB", "size") == 3 * 10**9
    assert parse_request_size(4096, "size") == 4096
    assert parse_request_size("none", "size") is None


def test_the_routes_steer_an_elastic_engine(tiny, ledger_dir):
    engine = engine_for(tiny, kv_memory="elastic", engine_name="ctl",
                        kv_cache_memory_bytes="4MiB")
    app = create_app(AsyncLLMEngine(engine), api_key="s3cret")
    with TestClient(app) as http:
        assert http.get("/kvcache/status").status_code == 401  # behind the server's key
        complete(http, "hello there, a prompt of a few blocks " * 3)
        # pre-mapping runs on after the request: let it finish, so that the status and the
        # ledger entry read below see the same mapped pages
        engine.kv_storage.settle()
        status = http.get("/kvcache/status", headers=KEY).json()
        assert status["self_ipc_name"] == "ctl"
        [seg] = status["segments"]
        e = entry(ledger_dir)
        assert seg["ipc_name"] == "ctl" and seg["total_size"] == 4 * MIB
        assert seg["physical_occupied"] == e.mapped_bytes > 0
        assert seg["used_size"] == e.live_bytes + e.cached_bytes > 0  # the cached prompt
        assert seg["prealloc_size"] == e.mapped_bytes - seg["used_size"]
        assert seg["safety_floor"] == seg["min_safe_limit"] == e.request_bytes > 0
        assert seg["total_size_human"] == "4.00 MiB"
        assert status["kvmem"]["engine"]["mapped_bytes"] == e.mapped_bytes
        assert status["gpu_total_memory"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")
        assert http.head("/kvcache/status", headers=KEY).content == b""

        reply = http.post("/kvcache/limit", json={"size": "3M"}, headers=KEY).json()
        assert reply["success"] and not reply["clamped"]
        assert reply["previous_total_size"] == 4 * MIB
        assert reply["new_total_size"] == entry(ledger_dir).ceiling_bytes == 3 * MIB
        floor = http.get("/kvcache/safety_floor", headers=KEY).json()["safety_floor"]
        low = http.post("/kvcache/limit", json={"size_bytes": 1}, headers=KEY).json()
        assert low["clamped"] and entry(ledger_dir).ceiling_bytes == floor
        http.post("/kvcache/limit", json={"size": "none", "floor": "1M"}, headers=KEY)
        assert entry(ledger_dir).ceiling_bytes is None
        assert entry(ledger_dir).floor_bytes == MIB

        half = http.post("/kvcache/limit_percent", json={"percent": 50}, headers=KEY).json()
        assert half["percent"] == 50
        assert entry(ledger_dir).ceiling_bytes == half["gpu_total_memory"] // 2

        # trim: the ceiling falls to what running requests hold (none: the safety floor),
        # and the engine gives back its free pages and cached blocks at its heartbeat
        trim = http.post("/kvcache/trim", headers=KEY).json()
        assert trim["new_limit"] == max(entry(ledger_dir).live_bytes, floor, MIB)
        deadline = time.monotonic() + 10
        while entry(ledger_dir).mapped_bytes > trim["new_limit"]:
            assert time.monotonic() < deadline, entry(ledger_dir)
            time.sleep(0.05)
        complete(http, "still serving under the trimmed limit")


@pytest.mark.parametrize(("method", "path", "body", "status", "names"), [
    ("post", "/kvcache/limit", {"size": "banana"}, 400, "size"),
    ("post", "/kvcache/limit", {"size": True}, 400, "size"),
    ("post", "/kvcache/limit", {"size": "-3G"}, 400, "size"),
    ("post", "/kvcache/limit", {"size_bytes": 1e300}, 400, "size_bytes"),
    ("post", "/kvcache/limit", {"size_bytes": 10**400}, 400, "size_bytes"),
    ("post", "/kvcache/limit", {}, 400, "size"),
    ("post", "/kvcache/limit", {"size": "1G", "size_bytes": 5}, 400, "size_bytes"),
    ("post", "/kvcache/limit", {"size": "1G", "force": "yes"}, 400, "force"),
    ("post", "/kvcache/limit", {"size": "1G", "ipc_name": " "}, 400, "ipc_name"),
    ("post", "/kvcache/limit", {"size": "1G", "ipc_name": 7}, 400, "ipc_name"),
    ("post", "/kvcache/limit", {"size": "1G", "ipc_name": "nobody"}, 404, "nobody"),
    ("post", "/kvcache/limit_percent", {"percent": 0}, 400, "percent"),
    ("post", "/kvcache/limit_percent", {"percent": 101}, 400, "percent"),
    ("post", "/kvcache/limit_percent", {"percent": "20"}, 400, "percent"),
    ("post", "/kvcache/trim", {"target": "x"}, 400, "target"),
    ("get", "/kvcache/limit", None, 405, "POST"),
    ("post", "/kvcache/status", {}, 405, "GET"),
    ("get", "/kvcache/nope", None, 404, "/kvcache/status"),
])
def test_bad_requests_are_one_line_4xx_naming_the_field(elastic_http, method, path, body,
                                                         status, names):
    kw = {"json": body} if body is not None else {}
    reply = getattr(elastic_http, method)(path, headers=KEY, **kw)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert names in error and "\n" not in error


def test_bodies_that_are_not_a_json_object_or_too_large(elastic_http):
    for raw in (b"{", b"[1, 2]", b"[" * 100_000):
        reply = elastic_http.post("/kvcache/limit", content=raw, headers=KEY)
        assert reply.status_code in (400, 413), reply.text
    reply = elastic_http.post("/kvcache/limit", content=b"x" * 10_000, headers=KEY)
    assert reply.status_code == 413
    complete(elastic_http, "the engine still serves")


def test_another_engine_is_named_with_ipc_name(elastic_http, ledger_dir):
    other = Ledger.for_device("cpu", ledger_dir).register("other", ceiling_bytes=8 * MIB)
    try:
        reply = elastic_http.post("/kvcache/limit", headers=KEY,
                                  json={"size": "2M", "ipc_name": "other"}).json()
        assert reply["ipc_name"] == "other" and entry(ledger_dir, "other").ceiling_bytes == 2 * MIB
        assert entry(ledger_dir).ceiling_bytes == 4 * MIB  # this engine's own is unchanged
        status = elastic_http.get("/kvcache/status", headers=KEY,
                                  params={}).json()
        assert status["segments"][0]["ipc_name"] == "ctl"
    finally:
        other.close()


@pytest.fixture()
def elastic_http(tiny, ledger_dir):
    app = app_for(tiny, kv_memory="elastic", engine_name="ctl", kv_cache_memory_bytes="4MiB")
    with TestClient(app) as http:
        yield http


def test_an_engine_without_elastic_memory_says_so(tiny, ledger_dir):
    with TestClient(app_for(tiny, kv_cache_memory_bytes="4MiB")) as http:
        reply = http.get("/kvcache/status", headers=KEY)
        assert reply.status_code == 409 and "--kv-memory elastic" in reply.json()["error"]


@pytest.fixture()
def ledger_control(tmp_path):
    """The routes for engine ``a`` of a ledger (no engine behind it: the ledger alone)."""
    budget = Ledger.for_device("cpu", tmp_path).register("a")
    yield KVCacheControl("a", ledger_dir=tmp_path)
    budget.close()


def test_a_field_given_twice_is_refused(ledger_control, tmp_path):
    """Python's JSON keeps the last of two equal keys; which size was meant is unknown."""
    status, doc = ledger_control.handle("POST", "/kvcache/limit",
                                        b'{"size": "1G", "size": "2G"}')
    assert status == 400 and "size" in doc["error"]
    assert entry(tmp_path, "a").ceiling_bytes is None


def test_a_body_that_never_ends_is_answered_408(ledger_control, monkeypatch):
    """A chunked body whose end never comes gets 408 after BODY_TIMEOUT_S, not a wait
    for ever."""
    monkeypatch.setattr(http_control, "BODY_TIMEOUT_S", 0.3)

    async def app(scope, receive, send):
        raise AssertionError("the routes never reach the app")

    async def receive():
        await asyncio.sleep(0.01)
        return {"type": "http.request", "body": b" ", "more_body": True}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/kvcache/limit", "method": "POST", "headers": []}
    middleware = http_control.KVCacheControlMiddleware(app, ledger_control)
    asyncio.run(asyncio.wait_for(middleware(scope, receive, send), 5))
    assert sent[0]["status"] == 408 and b"0.3 s" in sent[1]["body"]


def test_limits_from_many_clients_at_once_leave_one_of_them(ledger_control, tmp_path):
    """Concurrent limit and trim requests each take the ledger's lock: all succeed, and the
    ceiling left is one of those asked for."""
    sizes = [(i + 1) * MIB for i in range(8)]

    def client(size: int) -> list[int]:
        return [ledger_control.handle("POST", "/kvcache/" + route,
                                      json.dumps({key: size}).encode())[0]
                for route, key in [("limit", "size_bytes"), ("trim", "target_bytes")] * 5]

    with ThreadPoolExecutor(len(sizes)) as pool:
        statuses = [s for done in pool.map(client, sizes) for s in done]
    assert statuses == [200] * len(statuses)
    assert entry(tmp_path, "a").ceiling_bytes in sizes


# -- GET /kvcache/status/stream -------------------------------------------------------------

class _Client:
    """One streaming request driven through the middleware: its events as they come, and
    a disconnect when the test says so."""

    def __init__(self, control, query: bytes = b"", method: str = "GET") -> None:
        self.scope = {"type": "http", "path": "/kvcache/status/stream", "method": method,
                      "headers": [], "query_string": query}
        self.middleware = http_control.KVCacheControlMiddleware(self._app, control)
        self.messages: list[dict] = []
        self.leave = asyncio.Event()

    @staticmethod
    async def _app(scope, receive, send):
        raise AssertionError("the stream never reaches the app")

    async def _receive(self):
        if self.scope.get("_asked"):
            await self.leave.wait()
            return {"type": "http.disconnect"}
        self.scope["_asked"] = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def _send(self, message):
        self.messages.append(message)

    def run(self, during) -> None:
        """Stream while ``during(client)`` (a coroutine function) runs, then leave."""
        async def both():
            task = asyncio.create_task(self.middleware(self.scope, self._receive, self._send))
            try:
                await during(self)
            finally:
                self.leave.set()
            await asyncio.wait_for(task, 5)
        asyncio.run(both())

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    def events(self) -> list[tuple[str, dict]]:
        out = []
        for chunk in self.body.decode().split("\n\n"):
            lines = dict(line.split(": ", 1) for line in chunk.splitlines()
                         if not line.startswith(":"))
            if "event" in lines:
                out.append((lines["event"], json.loads(lines["data"])))
        return out

    async def wait_for_events(self, n: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events()) < n:
            assert time.monotonic() < deadline, self.body
            await asyncio.sleep(0.02)


def ceiling_of(doc: dict) -> int | None:
    return doc["kvmem"]["engine"]["ceiling_bytes"]


def test_the_status_stream_sends_the_status_then_each_change(ledger_control, tmp_path):
    """The first event is the status; a new ceiling in the ledger is a second one within
    a few looks; looks that find nothing new but the ages send nothing."""
    client = _Client(ledger_control, b"interval=0.05")

    async def during(c):
        await c.wait_for_events(1)
        await asyncio.sleep(0.5)  # ten looks; the ages move, nothing else
        assert len(c.events()) == 1
        Ledger.for_device("cpu", tmp_path).set_limits("a", ceiling_bytes=3 * MIB)
        await c.wait_for_events(2)

    client.run(during)
    start = client.messages[0]
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    (first_kind, first), (second_kind, second) = client.events()
    assert first_kind == second_kind == "status"
    assert first["self_ipc_name"] == "a" and ceiling_of(first) is None
    assert ceiling_of(second) == 3 * MIB
    assert second["segments"][0]["total_size"] == 3 * MIB


def test_a_quiet_stream_is_kept_alive_and_a_gone_engine_ends_it(tmp_path, monkeypatch):
    """Comment lines keep a quiet stream open; an engine that leaves the ledger gets a
    ``gone`` event and the response ends."""
    monkeypatch.setattr("kvmem.memory.status_stream.KEEPALIVE_S", 0.1)
    budget = Ledger.for_device("cpu", tmp_path).register("a")
    client = _Client(KVCacheControl("a", ledger_dir=tmp_path), b"interval=0.05")

    async def during(c):
        await asyncio.sleep(0.5)
        assert c.body.count(b": keepalive\n\n") >= 2
        budget.close()
        await c.wait_for_events(2)
        deadline = time.monotonic() + 5
        while c.messages[-1].get("more_body", True):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    client.run(during)
    kinds = [kind for kind, _ in client.events()]
    assert kinds == ["status", "gone"]
    assert "a" in client.events()[1][1]["error"]


def test_a_client_that_leaves_ends_the_stream_at_once(ledger_control):
    client = _Client(ledger_control, b"interval=60")

    async def during(c):
        await c.wait_for_events(1)

    started = time.monotonic()
    client.run(during)  # the middleware returns within run's 5 s, not after 60
    assert time.monotonic() - started < 5
    assert [kind for kind, _ in client.events()] == ["status"]


@pytest.mark.parametrize(("query", "method", "status", "names"), [
    (b"interval=0.001", "GET", 400, "interval"),
    (b"interval=61", "GET", 400, "interval"),
    (b"interval=soon", "GET", 400, "interval"),
    (b"interval=nan", "GET", 400, "interval"),
    (b"interval=1&interval=2", "GET", 400, "interval"),
    (b"colour=blue", "GET", 400, "colour"),
    (b"%ff=1", "GET", 400, "query"),
    (b"ipc_name=", "GET", 400, "ipc_name"),
    (b"ipc_name=nobody", "GET", 404, "nobody"),
    (b"", "POST", 405, "GET"),
])
def test_a_bad_stream_request_is_a_one_line_4xx(ledger_control, query, method, status, names):
    client = _Client(ledger_control, query, method)

    async def during(c):
        pass

    client.run(during)
    start, body = client.messages
    assert start["status"] == status
    error = json.loads(body["body"])["error"]
    assert names in error and "\n" not in error


def test_the_status_stream_on_kvmem_serves_port(tiny, tmp_path):
    """``kvmem serve`` streams its engine's status behind its key; a limit set over HTTP
    arrives in the stream, and the engine serves on."""
    from serve_process import ServeProcess

    server = ServeProcess(tiny, "--served-model-name", "tiny", "--max-model-len", "128",
                          "--kv-memory", "elastic", "--engine-name", "streamed",
                          "--kv-cache-memory-bytes", "4MiB", "--api-key", "s3cret",
                          "--log-level", "warning",
                          env={"KVMEM_LEDGER_DIR": str(tmp_path / "ledger")})
    try:
        with httpx.Client(base_url=server.base, timeout=30) as http:
            assert http.get("/kvcache/status/stream").status_code == 401
            seen = []
            with http.stream("GET", "/kvcache/status/stream", params={"interval": 0.05},
                             headers=KEY) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                for line in stream.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    seen.append(json.loads(line.removeprefix("data: ")))
                    if len(seen) == 1:
                        assert ceiling_of(seen[0]) == 4 * MIB
                        assert http.post("/kvcache/limit", json={"size": "3M"},
                                         headers=KEY).status_code == 200
                    elif ceiling_of(seen[-1]) == 3 * MIB:
                        break
            assert seen[0]["self_ipc_name"] == "streamed"
            complete(http, "still serving after the stream")

            # a server told to stop ends its open streams first: they do not hold its
            # graceful shutdown (uvicorn would wait for them, then cancel them after
            # GRACEFUL_SHUTDOWN_S + its margin, 10 s)
            lines = []
            with http.stream("GET", "/kvcache/status/stream", headers=KEY) as stream:
                for line in stream.iter_lines():
                    lines.append(line)
                    if line.startswith("data: ") and len(lines) < 3:
                        stopped = time.monotonic()
                        server.proc.terminate()
            assert lines[-3:-1] == ["event: gone",
                                    'data: {"error": "the server is shutting down"}']
            server.proc.wait(timeout=30)
            assert time.monotonic() - stopped < 5
    finally:
        server.proc.kill()
        server.proc.wait(timeout=30)
