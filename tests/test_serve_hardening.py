"""Hostile input to the HTTP server: text that is not Unicode, huge prompts and bodies,
loosely typed fields, requests without the API key, and SIGTERM with streams open. Each
gets a 4xx (or a final error event) in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from serve_process import ServeProcess
from tiny_models import make_tiny_checkpoint

MODEL = "tiny"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # long positions: a request can run for seconds
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hardening"), "llama",
                                max_position_embeddings=8192)


def make_app(model_dir, **kwargs):
    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), served_model_name=MODEL, max_model_len=64,
        kv_cache_memory_bytes=1 << 20)))
    return create_app(engine, **kwargs)


@pytest.fixture(scope="module")
def http(model_dir):
    with TestClient(make_app(model_dir)) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- text that is not valid Unicode ---------------------------------------------------------
# "\ud800" is valid JSON but a lone UTF-16 surrogate: no tokenizer can encode it. The bodies
# are written by hand because a JSON encoder given a Python str would refuse it.
SURROGATE_BODIES = {
    "prompt": ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}'),
    "prompt.1": ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "a\\udc00"]}'),
    "stop": ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}'),
    "messages.0.content": ("/v1/chat/completions",
                           '{"model": "tiny", "messages": [{"role": "user", '
                           '"content": "a\\ud800b"}]}'),
    "messages.1.content": ("/v1/chat/completions",
                           '{"model": "tiny", "messages": [{"role": "system", "content": "s"}, '
                           '{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
    "chat stop": ("/v1/chat/completions",
                  '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                  '"stop": "x\\ud800"}'),
}


@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
def test_a_lone_surrogate_is_a_400_naming_the_field(http, case):
    route, body = SURROGATE_BODIES[case]
    error = error_of(http.post(route, content=body.encode(), headers=JSON), 400)
    param = "stop" if case == "chat stop" else case.removesuffix(".1")
    assert error["param"] == param and "Unicode" in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "still", "max_tokens": 2})
    assert ok.status_code == 200


def test_the_tokenizer_refuses_a_lone_surrogate_wherever_text_comes_from(model_dir):
    """The chat template's output is encoded too: a template that adds such text to the
    prompt is caught there, not by a TypeError from the tokenizer library."""
    from kvmem.engine.errors import InvalidRequestError
    from kvmem.engine.loader import resolve_model

    tokenizer = resolve_model(str(model_dir)).tokenizer
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        tokenizer.encode("chat template output \udbff", add_special_tokens=False,
                         param="messages")
    assert info.value.param == "messages"
    assert tokenizer.decode(tokenizer.encode("fine", add_special_tokens=False)) == "fine"


# -- strict types ---------------------------------------------------------------------------
LOOSE = [  # values the OpenAI API rejects and pydantic's lax mode would coerce
    ("max_tokens", "4"), ("max_tokens", True), ("max_tokens", 4.0), ("stream", "yes"),
    ("stream", 1), ("temperature", "0.5"), ("temperature", True), ("seed", "7"),
    ("top_k", False), ("ignore_eos", "true"), ("n", True), ("stop", 5), ("model", 3),
    ("stream_options.include_usage", "yes"), ("stop_token_ids", ["1"]), ("prompt", [True]),
    ("prompt", 12),
]


@pytest.mark.parametrize(("field", "value"), LOOSE, ids=[f"{f}={v!r}" for f, v in LOOSE])
def test_loosely_typed_fields_are_400_with_param(http, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    if field == "stream_options.include_usage":
        body.update(stream=True, stream_options={"include_usage": value})
    else:
        body[field] = value
    param = "stop_token_ids.0" if field == "stop_token_ids" else field  # the bad element
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


CHAT_LOOSE = [("max_completion_tokens", "8"), ("messages.0.content", 5),
              ("messages.0.role", True),
              ("messages.0.content", [{"type": "text", "text": 5}]),
              ("messages.0.content", [{"type": "text", "text": None}])]


@pytest.mark.parametrize(("field", "value"), CHAT_LOOSE,
                         ids=[f"{f}={v!r}" for f, v in CHAT_LOOSE])
def test_loosely_typed_chat_fields_are_400_with_param(http, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if field.startswith("messages"):
        body["messages"][0][field.rsplit(".", 1)[1]] = value
    else:
        body[field] = value
    param = error_of(http.post("/v1/chat/completions", json=body), 400)["param"]
    assert param == field or isinstance(value, list) and field.startswith(param)


def test_well_typed_values_still_pass(http):
    """Integers are valid numbers (temperature 0), and null is still 'not given'."""
    body = {"model": MODEL, "prompt": [104, 105], "max_tokens": 2, "temperature": 0,
            "top_p": 1, "seed": None, "stop": None, "stream": False}
    assert http.post("/v1/completions", json=body).status_code == 200
    chat = {"model": MODEL, "max_completion_tokens": 2, "temperature": 1,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


# -- the request-body limit -----------------------------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_parsed(model_dir):
    with TestClient(make_app(model_dir, max_request_bytes=1000)) as http:
        big = {"model": MODEL, "prompt": "x" * 2000}
        error = error_of(http.post("/v1/completions", json=big), 413)
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(30):
                yield b" " * 100

        error = error_of(http.post("/v1/completions", content=chunks(), headers=JSON), 413)
        assert error["code"] == "request_too_large"
        error = error_of(http.post("/v1/completions", content=b"{" + b" " * 1200, headers=JSON),
                         413)  # not even parsed: a malformed body over the limit is still 413
        ok = {"model": MODEL, "prompt": "x" * 20, "max_tokens": 2}
        assert http.post("/v1/completions", json=ok).status_code == 200


# -- the API key ----------------------------------------------------------------------------
def test_the_api_key_is_checked_before_the_body_and_covers_metrics(model_dir):
    key = {"Authorization": "Bearer s3cret"}
    with TestClient(make_app(model_dir, api_key="s3cret", max_request_bytes=1000)) as http:
        for body in (b'{"model": ', b'{"model": "tiny", "prompt": "hi", "max_tokens": "x"}',
                     b"x" * 5000):  # malformed, badly typed, over the body limit
            error = error_of(http.post("/v1/completions", content=body, headers=JSON), 401)
            assert error["code"] == "invalid_api_key"
        error_of(http.get("/metrics"), 401)
        error_of(http.get("/v1/models"), 401)
        error_of(http.get("/v1/nothing"), 401)  # an unknown route tells nothing either
        error_of(http.get("/openapi.json", headers={"Authorization": "Bearer wrong"}), 401)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics", headers=key).status_code == 200
        assert error_of(http.post("/v1/completions", content=b'{"model": ',
                                  headers={**JSON, **key}), 400)["code"] == "invalid_json"
        assert error_of(http.post("/v1/completions", content=b"x" * 5000,
                                  headers={**JSON, **key}), 413)["code"] == "request_too_large"
    with TestClient(make_app(model_dir, api_key="s3cret", public_metrics=True)) as http:
        assert http.get("/metrics").status_code == 200
        error_of(http.get("/v1/models"), 401)


# -- a real server: huge prompts and SIGTERM ------------------------------------------------
def test_health_answers_while_a_huge_prompt_is_tokenized(model_dir):
    """Tokenizing ~3 MB takes seconds: it must not hold the event loop (nor the GIL), so
    /health answers again and again while it runs (a blocked loop would answer the first
    probe only once the prompt is done); then the prompt gets its 400."""
    server = ServeProcess(model_dir, "--served-model-name", MODEL, "--max-model-len", "128",
                          "--kv-cache-memory-bytes", "4MiB", "--log-level", "warning")
    result: dict = {}

    def huge() -> None:
        result["response"] = httpx.post(f"{server.base}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "hello world " * 250_000})

    try:
        sender = threading.Thread(target=huge)
        answered_during = 0  # /health answers that came while the prompt was still in flight
        with httpx.Client(base_url=server.base, timeout=120) as probe:
            sender.start()
            while sender.is_alive():
                assert probe.get("/health").status_code == 200
                answered_during += sender.is_alive()
                time.sleep(0.1)
        sender.join()
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=30)
    error = error_of(result["response"], 400)
    assert error["code"] == "context_length_exceeded" and "3000000 tokens" in error["message"]
    assert answered_during >= 5
    assert code == 0


BODY_NEVER_WHOLE = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
HEAD_NEVER_WHOLE = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app"


def trickle(port: int, wait_s: float, sent: bytes = BODY_NEVER_WHOLE) -> bytes:
    """Send the start of a request that never arrives whole (by default its head and one
    byte of its body of 100); what the server answers within ``wait_s``."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(sent)
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except TimeoutError:
            pass
    return answer


def test_sigterm_ends_every_open_stream_with_an_error_event_and_done(model_dir):
    """Streams still running after the graceful-shutdown time get a final OpenAI-style
    error event and ``data: [DONE]``; the process exits 0 with no traceback in its log.
    Before that, on the same server: bodies and heads (request line and headers) that
    trickle in are answered 408 once their time limit passes (they used to stay open
    indefinitely), and the server serves on."""
    server = ServeProcess(model_dir, "--served-model-name", MODEL, "--max-model-len", "8192",
                          "--kv-cache-memory-bytes", "8MiB", "--max-request-bytes", "4KiB",
                          "--request-body-timeout", "1", "--request-head-timeout", "1")
    error_of(httpx.post(f"{server.base}/v1/completions",  # the flag reaches the app
                        json={"model": MODEL, "prompt": "x" * 5000}), 413)
    answers: list[bytes] = []
    slow = [threading.Thread(target=lambda sent=sent: answers.append(
        trickle(server.port, 120, sent))) for sent in [BODY_NEVER_WHOLE] * 10 + [
            HEAD_NEVER_WHOLE] * 10]
    for t in slow:
        t.start()
    for t in slow:
        t.join()
    # each is answered 408 by the server (a client giving up first would have no answer)
    assert len(answers) == 20 and all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
    assert all(b'"code":"request_timeout"' in a for a in answers)
    assert sum(b"request head did not arrive within 1 s" in a for a in answers) == 10
    assert httpx.get(f"{server.base}/health").status_code == 200
    bodies = [("completions", {"prompt": "go"}), ("completions", {"prompt": "again"}),
              ("chat/completions", {"messages": [{"role": "user", "content": "go"}]})]
    events: dict[int, list[str]] = {}
    started = threading.Barrier(len(bodies) + 1, timeout=60)

    def stream(i: int, route: str, body: dict) -> None:
        lines: list[str] = []
        try:
            with httpx.stream("POST", f"{server.base}/v1/{route}", timeout=60, json={
                    "model": MODEL, "max_tokens": 8000, "ignore_eos": True, "stream": True,
                    **body}) as response:
                for line in response.iter_lines():
                    if line and not lines:
                        started.wait()
                    if line:
                        lines.append(line)
        except httpx.HTTPError as e:  # a cut connection: what must not happen
            lines.append(repr(e))
        events[i] = lines

    threads = [threading.Thread(target=stream, args=(i, *b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    try:
        started.wait()  # every stream has its first event
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        code = server.proc.wait(timeout=30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    time.sleep(0.2)  # the log reader's last lines
    log = "".join(server.lines)
    for i in range(len(bodies)):
        lines = events[i]
        assert len(lines) > 2 and lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable"
        assert error["message"] == "the server is shutting down; the request was aborted"
    assert code == 0 and "Traceback" not in log and "CancelledError" not in log, log
