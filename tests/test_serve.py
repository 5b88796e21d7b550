"""A real ``kvmem serve`` process on loopback, driven by the official ``openai`` client,
plus the bad-request cases (each a 4xx with an OpenAI error body) and clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from tiny_models import make_tiny_checkpoint

MODEL = "tiny"
STARTUP_TIMEOUT_S = 120
LISTENING = b"kvmem: listening on "


def start_server(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    """``kvmem serve`` on a port it binds itself (``--port 0``): a port picked here and
    bound later by the server could be taken meanwhile by another process, whose server
    the test would then talk to."""
    cmd = [sys.executable, "-m", "kvmem", "serve", str(model_dir), "--port", "0",
           "--served-model-name", MODEL, "--max-model-len", "128",
           "--kv-cache-memory-bytes", "4MiB", "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    early = []
    while (line := proc.stdout.readline()) and not line.startswith(LISTENING):
        early.append(line)  # warnings before the server binds its port
    if not line:
        raise RuntimeError(f"server exited early: {b''.join(early).decode()}")
    base = line.decode().removeprefix(LISTENING.decode()).strip()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {proc.stdout.read().decode()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy in time")


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return proc.returncode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # long positions: a request can run for seconds
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve"), "llama",
                                max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(model_dir):
    proc, base = start_server(model_dir)
    try:
        yield base
    finally:
        assert stop_server(proc) == 0  # SIGTERM: clean shutdown


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    assert httpx.get(f"{server}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_non_streaming_and_streaming_agree(client):
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(b"Hello there")  # byte-level tokenizer
    assert full.usage.completion_tokens == 10 and full.usage.total_tokens == 21
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_completion_batch_of_prompts(client):
    out = client.completions.create(model=MODEL, prompt=["a", "bcd"], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 6


def test_chat_non_streaming_and_streaming_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_and_seed(client):
    kw = dict(model=MODEL, prompt="xyz", max_tokens=12, temperature=0.9, seed=5,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample
    stop = a.choices[0].text[4:6]
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == a.choices[0].text[:a.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_get_4xx_and_engine_keeps_serving(server, client):
    url = f"{server}/v1/completions"
    headers = {"content-type": "application/json"}
    error = error_of(httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers=headers), 400)
    assert "malformed JSON" in error["message"]
    error = error_of(httpx.post(url, json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    error = error_of(httpx.post(url, json={"model": MODEL, "prompt": "x" * 200}), 400)
    assert error["code"] == "context_length_exceeded" and "max_model_len is 128" in error["message"]
    error = error_of(httpx.post(url, json={"model": MODEL, "prompt": "hi", "temperature": -1}), 400)
    assert error["param"] == "temperature"
    error = error_of(httpx.post(url, json={"model": MODEL, "prompt": "hi", "top_p": 7}), 400)
    assert error["param"] == "top_p"
    error = error_of(httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": "many"}),
                     400)
    assert error["param"] == "max_tokens"
    error = error_of(httpx.post(url, json={"prompt": "hi"}), 400)
    assert error["param"] == "model"
    chat = f"{server}/v1/chat/completions"
    for seed in (2**64, -2**63 - 1):  # beyond what torch.Generator.manual_seed takes
        error = error_of(httpx.post(url, json={"model": MODEL, "prompt": "hi", "seed": seed}), 400)
        assert error["param"] == "seed"
        messages = [{"role": "user", "content": "hi"}]
        error = error_of(httpx.post(chat, json={"model": MODEL, "messages": messages,
                                                "seed": seed}), 400)
        assert error["param"] == "seed"
    error_of(httpx.post(chat, json={"model": MODEL, "messages": []}), 400)
    error_of(httpx.post(chat, json={"model": MODEL, "messages": [{"role": "robot"}]}), 400)
    error_of(httpx.get(f"{server}/v1/nothing"), 404)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=500)
    out = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_metrics_count_requests_tokens_and_blocks(server, client):
    def scrape() -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{server}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    prompt = "shared prefix " * 4  # 56 bytes: three full blocks are cached after the first
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape()
    label = f'{{model_name="{MODEL}"}}'
    assert after[f"kvmem_requests_received_total{label}"] - \
        before[f"kvmem_requests_received_total{label}"] == 2
    assert after[f"kvmem_generation_tokens_total{label}"] - \
        before[f"kvmem_generation_tokens_total{label}"] == 8
    assert after[f"kvmem_prefix_cache_hits_total{label}"] - \
        before[f"kvmem_prefix_cache_hits_total{label}"] == 48
    assert after[f"kvmem_num_requests_running{label}"] == 0
    assert after[f'kvmem_kv_blocks{{model_name="{MODEL}",state="cached"}}'] >= 3
    assert after[f"kvmem_kv_blocks_total{label}"] > 0
    assert 0 < after[f"kvmem_prefix_cache_hit_rate{label}"] <= 1
    assert after[f"kvmem_preemptions_total{label}"] == before[f"kvmem_preemptions_total{label}"]


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def scrape(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{base}/metrics").text)


def test_metrics_values_through_a_run_that_preempts(model_dir):
    """7 blocks of 16 tokens, three requests growing to 60 tokens (4 blocks) each: the
    scheduler must preempt, and the gauges must say what the scheduler holds."""
    from prometheus_client import generate_latest

    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.engine.sampling_params import SamplingParams
    from kvmem.serve.metrics import make_registry

    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=64, block_size=16,
                                    kv_cache_memory_bytes=8 * 8192, enable_prefix_caching=False))
    registry = make_registry(engine.snapshot, MODEL)
    label = f'{{model_name="{MODEL}"}}'

    def metric(name: str, state: str | None = None) -> float:
        values = parse_metrics(generate_latest(registry).decode())
        key = f'{name}{{model_name="{MODEL}",state="{state}"}}' if state else f"{name}{label}"
        return values[key]

    for i in range(3):
        engine.add_request(f"r{i}", [1 + i] * 20, SamplingParams(max_tokens=40, temperature=0,
                                                                 ignore_eos=True))
    total, preempted, checked = metric("kvmem_kv_blocks_total"), 0, False
    assert total == 7 and metric("kvmem_num_requests_waiting") == 3
    while engine.has_unfinished_requests():
        before = {r.request_id for r in engine.scheduler.running}
        outputs = engine.step()
        done = {o.request_id for o in outputs if o.finished}
        lost = before - done - {r.request_id for r in engine.scheduler.running}
        preempted += len(lost)
        assert metric("kvmem_preemptions_total") == preempted
        assert metric("kvmem_num_requests_waiting") == len(engine.scheduler.waiting)
        used = sum(-(-r.num_computed_tokens // 16) for r in engine.scheduler.running)
        assert metric("kvmem_kv_blocks", "used") == used
        assert metric("kvmem_kv_blocks", "free") == total - used
        if lost and not checked:  # the first preemption: one request back in the queue
            assert metric("kvmem_num_requests_waiting") == 1 and used == 6
            checked = True
    assert checked and preempted >= 1
    assert metric("kvmem_kv_blocks", "used") == 0 and metric("kvmem_kv_blocks", "free") == 7
    assert metric("kvmem_num_requests_waiting") == metric("kvmem_num_requests_running") == 0
    assert metric("kvmem_generation_tokens_total") == 3 * 40


def test_a_client_that_hangs_up_aborts_its_non_streaming_request(model_dir):
    """~8000 tokens would take seconds; the client gives up after 0.3 s and closes the
    connection, so the engine must abort the request and free its blocks."""
    proc, base = start_server(model_dir, "--max-model-len", "8192",
                              "--kv-cache-memory-bytes", "8MiB")
    label = f'{{model_name="{MODEL}"}}'
    aborted = f'kvmem_requests_finished_total{{finish_reason="abort",model_name="{MODEL}"}}'
    try:
        bodies = {"completions": {"prompt": "go"},
                  "chat/completions": {"messages": [{"role": "user", "content": "go"}]}}
        for n, (route, body) in enumerate(bodies.items(), start=1):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/v1/{route}", timeout=httpx.Timeout(5, read=0.3), json={
                    "model": MODEL, "max_tokens": 8000, "ignore_eos": True, **body})
            deadline = time.monotonic() + 60  # ends as soon as it is counted
            while scrape(base)[aborted] < n and time.monotonic() < deadline:
                time.sleep(0.05)
            values = scrape(base)
            assert values[aborted] == n, route
            assert values[f"kvmem_num_requests_running{label}"] == 0
            assert values[f'kvmem_kv_blocks{{model_name="{MODEL}",state="used"}}'] == 0
            assert values[f"kvmem_generation_tokens_total{label}"] < 8000 * n
    finally:
        code = stop_server(proc)
    log = proc.stdout.read().decode()
    assert code == 0 and "Traceback" not in log and "CancelledError" not in log, log


def test_sigint_with_a_stream_in_flight_exits_cleanly(model_dir):
    proc, base = start_server(model_dir)
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json={
                "model": MODEL, "prompt": "go", "max_tokens": 100, "stream": True,
                "ignore_eos": True}) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: ") and json.loads(first[6:])["choices"]
            assert stop_server(proc, signal.SIGINT) == 0
    finally:
        stop_server(proc)


def test_api_key_and_not_ready_in_process(model_dir):
    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), served_model_name=MODEL, max_model_len=64,
        kv_cache_memory_bytes=1 << 20)))
    app = create_app(engine, api_key="s3cret")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with TestClient(app) as http:
        assert error_of(http.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        bad = {"Authorization": "Bearer nope"}
        error_of(http.post("/v1/completions", json=body, headers=bad), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert http.post("/v1/completions", json=body, headers=good).status_code == 200
        assert http.get("/health").status_code == 200  # health and metrics stay open
    # after shutdown the engine is not ready: health says so
    assert TestClient(app).get("/health").status_code == 503


def test_serve_binds_loopback_by_default(monkeypatch):
    from kvmem.cli import build_parser
    from kvmem.cli import serve as serve_cli

    parser, module = build_parser(["serve"])
    args = parser.parse_args(["serve"])
    assert module is serve_cli and (args.host, args.port) == ("127.0.0.1", 8000)
    bound, real_listen = [], serve_cli._listen

    def listen(host: str, port: int):  # the real bind, on a free port; then stop before loading
        with real_listen(host, 0) as sock:
            bound.append((host, port, sock.getsockname()[0]))
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cli, "_listen", listen)
    with pytest.raises(KeyboardInterrupt):
        serve_cli.run(args)
    assert bound == [("127.0.0.1", 8000, "127.0.0.1")]


def test_a_request_cancelled_at_shutdown_gets_a_503_and_is_aborted(model_dir):
    """uvicorn cancels what still runs when its graceful-shutdown time is over: the request
    is aborted in the engine and answered with an error body, not a CancelledError."""
    import asyncio

    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), served_model_name=MODEL, max_model_len=8192,
        kv_cache_memory_bytes=8 << 20)))
    body = {"model": MODEL, "prompt": "go", "max_tokens": 8000, "ignore_eos": True}

    async def cancelled_request() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvmem") as http:
            task = asyncio.ensure_future(http.post("/v1/completions", json=body))
            while engine.snapshot.num_running == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            return await task

    engine.start()
    try:
        response = asyncio.run(cancelled_request())
        deadline = time.monotonic() + 60  # ends as soon as it is counted
        while engine.snapshot.finished_requests.get("abort", 0) == 0 and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        snapshot = engine.snapshot
    finally:
        engine.shutdown()
    assert error_of(response, 503)["message"].startswith("the server is shutting down")
    assert snapshot.finished_requests.get("abort") == 1 and snapshot.kv_blocks_used == 0
