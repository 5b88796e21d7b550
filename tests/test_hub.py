"""Models from the Hugging Face Hub (kvmem.spec.hub), against a server on 127.0.0.1 laid out
as the Hub and named by HF_ENDPOINT.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, when it is imported, so
every check runs `kvmem plan` (or `kvmem ui`) in a subprocess with them set, as a user would.
"""

import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import pytest

KVMEM = [sys.executable, "-c", "import sys; from kvmem.cli import main; sys.exit(main())"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_granted"
# a small Qwen3-like model: 4 layers
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 4,
    "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}
_BITS = {"BF16": 16, "F32": 32, "U8": 8}


def tensors(cfg: dict) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of a checkpoint of ``cfg``; norms kept in float32, so the
    bytes differ from the config's bf16 estimate."""
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": ("BF16", [cfg["vocab_size"], h]),
           "lm_head.weight": ("BF16", [cfg["vocab_size"], h]),
           "model.norm.weight": ("F32", [h])}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": ("BF16", [q, h]),
                p + "self_attn.k_proj.weight": ("BF16", [kv, h]),
                p + "self_attn.v_proj.weight": ("BF16", [kv, h]),
                p + "self_attn.o_proj.weight": ("BF16", [h, q]),
                p + "mlp.gate_proj.weight": ("BF16", [i, h]),
                p + "mlp.up_proj.weight": ("BF16", [i, h]),
                p + "mlp.down_proj.weight": ("BF16", [h, i]),
                p + "input_layernorm.weight": ("F32", [h]),
                p + "post_attention_layernorm.weight": ("F32", [h])}
    return out


def nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _BITS[dtype] // 8


def safetensors_header(entries: dict[str, tuple[str, list[int]]], lie: int = 0) -> bytes:
    """A safetensors file's 8-byte length and JSON header, without the tensor data (the
    Hub is asked for the header only); ``lie`` adds to the last tensor's data offsets."""
    header, offset = {}, 0
    for name, (dtype, shape) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + nbytes(dtype, shape)]}
        offset += nbytes(dtype, shape)
    header[name]["data_offsets"][1] += lie
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def sharded(entries: dict) -> dict[str, bytes]:
    """Two shards and their model.safetensors.index.json."""
    names = list(entries)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    files = {f: safetensors_header({n: entries[n] for n in ns}) for f, ns in shards.items()}
    index = {"metadata": {"total_size": sum(nbytes(*e) for e in entries.values())},
             "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    return {**files, "model.safetensors.index.json": json.dumps(index).encode()}


class Hub:
    """The Hub's file endpoints for a few repos: HEAD/GET /{repo}/resolve/{rev}/{file}
    (ranges honoured), /api/models/{repo}/revision/{rev}, 401 for an unknown repo, 403 for
    a gated one without the token, 404 for a missing file. Records every request."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: tuple[str, ...] = (),
                 sizes: dict[str, int] | None = None):
        self.repos, self.gated, self.sizes = repos, gated, sizes or {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range
        self.tokens: list[tuple[str, str]] = []  # path, Authorization: every one sent
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append((req.command, req.path, req.headers.get("Range")))
        if req.headers.get("Authorization"):
            self.tokens.append((req.path, req.headers["Authorization"]))
        path = req.path.split("?")[0]
        if path.startswith("/api/models/"):
            repo, _, _rev = path.removeprefix("/api/models/").partition("/revision/")
            files = self._files(req, repo)
            if files is not None:
                doc = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
                self._send(req, 200, json.dumps(doc).encode(), body)
            return
        parts = path.lstrip("/").split("/", 4)
        if len(parts) != 5 or parts[2] != "resolve":
            return self._error(req, 404, "EntryNotFound", body)
        files = self._files(req, f"{parts[0]}/{parts[1]}")
        if files is None:
            return
        data = files.get(parts[4])
        if data is None:
            return self._error(req, 404, "EntryNotFound", body)
        headers = {"X-Repo-Commit": COMMIT,
                   "ETag": '"' + hashlib.sha1(data).hexdigest() + '"'}
        claimed = self.sizes.get(f"{parts[0]}/{parts[1]}/{parts[4]}")
        if claimed is not None:  # a size the server claims, whatever it sends
            headers["X-Linked-Size"] = str(claimed)
        status, rng = 200, req.headers.get("Range")
        if rng and body:
            start, _, end = rng.removeprefix("bytes=").partition("-")
            data = data[int(start): int(end) + 1 if end else None]
            status = 206
        self._send(req, status, data, body, headers)

    def _files(self, req, repo: str) -> dict[str, bytes] | None:
        if repo not in self.repos:
            self._error(req, 401, "RepoNotFound", req.command == "GET")
            return None
        if repo in self.gated and req.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(req, 403, "GatedRepo", req.command == "GET")
            return None
        return self.repos[repo]

    def _error(self, req, status: int, code: str, body: bool) -> None:
        self._send(req, status, json.dumps({"error": code}).encode(), body,
                   {"X-Error-Code": code})

    @staticmethod
    def _send(req, status: int, data: bytes, body: bool, headers: dict | None = None) -> None:
        req.send_response(status)
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)


def config_bytes(cfg: dict = CONFIG) -> bytes:
    return json.dumps(cfg).encode()


@pytest.fixture
def hub():
    entries = tensors(CONFIG)
    header = safetensors_header(entries)
    repos = {
        "acme/sharded": {"config.json": config_bytes(), **sharded(entries)},
        "acme/single": {"config.json": config_bytes(), "model.safetensors": header},
        "acme/no-weights": {"config.json": config_bytes()},
        "acme/gated": {"config.json": config_bytes(), "model.safetensors": header},
        "acme/not-json": {"config.json": b"{\"num_hidden_layers\": 4,"},
        "acme/a-list": {"config.json": b"[1, 2, 3]"},
        "acme/huge": {"config.json": b"{}"},
        "acme/wrong-types": {"config.json": config_bytes({**CONFIG, "num_hidden_layers": "many"})},
        "acme/petabytes": {"config.json": config_bytes(), "model.safetensors":
                           safetensors_header({"model.embed_tokens.weight":
                                               ("BF16", [1 << 30, 1 << 20])})},
        "acme/lying-header": {"config.json": config_bytes(),
                              "model.safetensors": safetensors_header(entries, lie=7)},
        "acme/huge-header": {"config.json": config_bytes(),
                             "model.safetensors": struct.pack("<Q", 1 << 40) + b"{}"},
        "acme/odd-dtype": {"config.json": config_bytes(), "model.safetensors":
                           safetensors_header({"model.norm.weight": ("F32", [256])}).replace(
                               b'"F32"', b'"Q3"')},
    }
    server = Hub(repos, gated=("acme/gated",))
    yield server
    server.close()


def kvmem(args: list[str], hub_url: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    environ |= {"HF_ENDPOINT": hub_url, "HF_HOME": str(home), "HF_HUB_ETAG_TIMEOUT": "5",
                "HF_HUB_DOWNLOAD_TIMEOUT": "5", **env}
    return subprocess.run([*KVMEM, *args], capture_output=True,
                          text=True, env=environ, timeout=120)


def plan_json(model: str, hub_url: str, home: Path, *flags: str, **env: str) -> dict:
    done = kvmem(["plan", model, "--gpu", "H100", "--json", *flags], hub_url, home, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The error line of a failed `kvmem plan`: exit 2, one line, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmem: error: "), done.stderr
    return lines[0]


def weights(doc: dict) -> list[int]:
    return [r["weights_bytes"] for r in doc["ranks"]]


def local_checkpoint(tmp_path: Path, files: dict[str, bytes]) -> Path:
    directory = tmp_path / "local"
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize("repo", ["acme/sharded", "acme/single"])
def test_a_hub_repo_plans_with_the_weight_bytes_of_its_headers(hub, tmp_path, repo):
    """The planner takes the bytes the safetensors headers give (dtype x shape), as it
    does for a local checkpoint of the same files; no weight is downloaded."""
    doc = plan_json(repo, hub.url, tmp_path / "hf")
    assert doc["model"] == repo
    assert weights(doc) == [sum(nbytes(*e) for e in tensors(CONFIG).values())]
    local = local_checkpoint(tmp_path, hub.repos[repo])
    for tp in ("1", "2"):
        assert weights(plan_json(repo, hub.url, tmp_path / "hf", "--tp", tp)) == \
            weights(plan_json(str(local), hub.url, tmp_path / "hf", "--tp", tp))
    estimate = weights(plan_json(str(local / "config.json"), hub.url, tmp_path / "hf"))
    assert estimate != weights(doc)  # the norms are float32 in the checkpoint
    weight_gets = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(".safetensors")]
    assert weight_gets and all(rng is not None and rng.startswith("bytes=")
                               for _, _, rng in weight_gets)
    if repo == "acme/sharded":
        assert any(r[1].endswith("/model.safetensors.index.json") for r in hub.requests)


def test_a_repo_read_once_plans_from_the_cache_offline_and_without_the_server(hub, tmp_path):
    home = tmp_path / "hf"
    first = plan_json("acme/sharded", hub.url, home)
    hub.close()
    assert plan_json("acme/sharded", hub.url, home, HF_HUB_OFFLINE="1") == first
    assert plan_json("acme/sharded", hub.url, home) == first  # the Hub unreachable: the cache


def test_a_repo_without_safetensors_has_its_weights_estimated(hub, tmp_path):
    doc = plan_json("acme/no-weights", hub.url, tmp_path / "hf")
    local = local_checkpoint(tmp_path, hub.repos["acme/no-weights"])
    assert weights(doc) == weights(plan_json(str(local), hub.url, tmp_path / "hf"))


def test_a_gated_repo_says_to_set_hf_token_and_plans_with_it(hub, tmp_path):
    line = one_line_error(kvmem(["plan", "acme/gated"], hub.url, tmp_path / "hf"))
    assert "gated" in line and "HF_TOKEN" in line and "config.json" in line
    doc = plan_json("acme/gated", hub.url, tmp_path / "hf", HF_TOKEN=TOKEN)
    assert weights(doc) == [sum(nbytes(*e) for e in tensors(CONFIG).values())]


@pytest.mark.parametrize(("repo", "env", "said"), [
    ("acme/missing", {}, "no model repo acme/missing on the Hub"),
    ("acme/missing", {"HF_HUB_OFFLINE": "1"}, "not in the Hub cache and HF_HUB_OFFLINE is set"),
    ("acme/not-json", {}, "config.json is not valid JSON"),
    ("acme/a-list", {}, "config.json is JSON but not an object"),
    ("acme/lying-header", {}, "do not span the"),
    ("acme/huge-header", {}, "safetensors header cannot be read"),
    ("acme/odd-dtype", {}, "unknown dtype 'Q3'"),
    ("acme/petabytes", {}, "claim 2048.00 TiB of weights, more than any checkpoint"),
])
def test_a_repo_that_cannot_be_planned_is_one_line(hub, tmp_path, repo, env, said):
    line = one_line_error(kvmem(["plan", repo], hub.url, tmp_path / "hf", **env))
    assert said in line and "pass its config instead" in line


def test_a_huge_config_is_refused_before_it_is_downloaded(hub, tmp_path):
    hub.sizes["acme/huge/config.json"] = 1 << 30
    line = one_line_error(kvmem(["plan", "acme/huge"], hub.url, tmp_path / "hf"))
    assert "1.00 GiB, larger than a config can be" in line
    assert not [r for r in hub.requests if r[0] == "GET" and "/acme/" in r[1]]


def test_a_repo_id_one_letter_off_a_catalog_id_suggests_it(tmp_path):
    line = one_line_error(kvmem(["plan", "qwen/qwen3-8c"], "http://127.0.0.1:9", tmp_path,
                                HF_HUB_OFFLINE="1"))
    assert line.endswith("did you mean qwen/qwen3-8b, qwen/qwen3-32b, qwen/qwen3-14b?")


def test_a_config_of_the_wrong_types_is_one_line(hub, tmp_path):
    line = one_line_error(kvmem(["plan", "acme/wrong-types"], hub.url, tmp_path / "hf"))
    assert "acme/wrong-types: field 'num_hidden_layers' must be a positive integer" in line


def test_a_server_that_sends_more_than_it_claims_is_one_line(hub, tmp_path):
    """The Hub claims 100 bytes and sends 65 MiB: streamed to the cache and refused, never
    held in memory or read as a config."""
    hub.repos["acme/liar"] = {"config.json": b"{" + b" " * (65 << 20) + b"}"}
    hub.sizes["acme/liar/config.json"] = 100
    line = one_line_error(kvmem(["plan", "acme/liar"], hub.url, tmp_path / "hf"))
    assert "acme/liar" in line and "pass its config instead" in line


def test_no_network_is_one_line_at_once(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    line = one_line_error(kvmem(["plan", "acme/sharded"], closed, tmp_path / "hf"))
    assert time.monotonic() - start < 30  # no backoff and retries (they take 24 s)
    assert f"cannot reach the Hub ({closed})" in line


@pytest.mark.parametrize("name", ["../../no/such/config.json", "acme/../secret", "https://evil/acme/x",
                                  "acme/x/../../y", "a" * 100 + "/x"])
def test_names_that_are_no_repo_id_never_reach_the_hub(hub, tmp_path, name):
    line = one_line_error(kvmem(["plan", name], hub.url, tmp_path / "hf"))
    assert line.startswith(f"kvmem: error: unknown model {name!r}")
    assert not [r for r in hub.requests if "acme" in r[1] or "evil" in r[1]]


def test_the_page_plans_a_hub_repo_and_answers_400_for_a_missing_one(hub, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    # the server holds a token; the page must not lend it to whoever asks
    environ |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": TOKEN}
    page = subprocess.Popen([*KVMEM, "ui", "--port", str(port)],
                            env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def api(model: str) -> tuple[int, dict]:
            url = f"http://127.0.0.1:{port}/api/plan?model={quote(model)}&gpu=H100"
            for _ in range(100):
                try:
                    with urllib.request.urlopen(url, timeout=30) as r:
                        return r.status, json.loads(r.read())
                except urllib.error.HTTPError as e:
                    return e.code, json.loads(e.read())
                except urllib.error.URLError:
                    time.sleep(0.2)  # not listening yet
            raise AssertionError("the page never answered")

        status, body = api("acme/single")
        assert status == 200, body
        assert body["ranks"][0]["weights_bytes"] == sum(
            nbytes(*e) for e in tensors(CONFIG).values())
        status, body = api("acme/missing")
        assert status == 400 and body["field"] == "model"
        assert "no model repo acme/missing on the Hub" in body["error"]
        status, body = api("acme/gated")
        assert status == 400 and "gated" in body["error"]
        assert hub.tokens == []  # the page asked the Hub anonymously
    finally:
        page.terminate()
        page.wait(timeout=30)
