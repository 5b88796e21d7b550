"""`kvmem ui`'s server and API without a browser: the query string is `kvmem plan`'s flags,
``/api/plan`` is `kvmem plan --json`'s document, a refusal is the CLI's line with its field,
no file of the server is read, the page's files ship in the package, no torch."""

import contextlib
import errno
import fnmatch
import json
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest

from kvmem.spec.catalog import catalog_config
from kvmem.ui.query import form, plan_parser
from tests.ui_page import README_EXAMPLE, README_QUERY, cli, cli_error, serving

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    with serving() as s:
        yield s


def get(server, path: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(server.url + path.lstrip("/"), timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def api(server, endpoint: str, query: str) -> tuple[int, dict]:
    status, _, body = get(server, f"/api/{endpoint}?{query}")
    return status, json.loads(body)


def cli_json(argv: list[str]) -> dict:
    code, out, err = cli(["plan", *argv, "--json"])
    assert code == 0, err
    return json.loads(out)


HUGE_QUERY = ("model=smollm2&device=cpu&kv_cache_memory_bytes=1GiB&engine=kvmem"
              "&kv_memory=elastic&kv_memory_huge_pages=true")


@pytest.mark.parametrize("query, argv", [
    (README_QUERY, README_EXAMPLE),
    (README_QUERY + "&engine=vllm", README_EXAMPLE + ["--engine", "vllm"]),
    ("model=qwen3-14b&pp=2&gpu=V100-16GB&gpu=V100-32GB&kv_budget=optimal&max_model_len=32768"
     "&engine=sglang", ["qwen3-14b", "--pp", "2", "--gpu", "V100-16GB", "--gpu", "V100-32GB",
                        "--kv-budget", "optimal", "--max-model-len", "32768", "--engine",
                        "sglang"]),
    ("model=qwen3-8b&gpu=H100&enforce_eager=true&cpu_offload_gib=4&engine=kvmem"
     "&kv_memory=elastic&kv_memory_limit=8GiB",
     ["qwen3-8b", "--gpu", "H100", "--enforce-eager", "--cpu-offload-gib", "4", "--engine",
      "kvmem", "--kv-memory", "elastic", "--kv-memory-limit", "8GiB"]),
    ("model=qwen3-8b&gpu=H100&enforce_eager=false&device=gpu", ["qwen3-8b", "--gpu", "H100"]),
    (HUGE_QUERY, ["smollm2", "--device", "cpu", "--kv-cache-memory-bytes", "1GiB", "--engine",
                  "kvmem", "--kv-memory", "elastic", "--kv-memory-huge-pages"]),
])
def test_api_plan_is_the_cli_json_document(server, query, argv):
    status, doc = api(server, "plan", query)
    assert status == 200
    assert doc == cli_json(argv)


def test_the_page_says_when_elastic_pages_are_huge_pages(server):
    _, view = api(server, "view", HUGE_QUERY)
    assert "pages of 64 (huge pages)" in view["elastic"][0]
    assert view["commands"][0]["shell"].endswith("--kv-memory-huge-pages")


def test_the_readme_example_over_the_api(server):
    status, doc = api(server, "plan", README_QUERY)
    assert status == 200
    assert [r["num_blocks"] for r in doc["ranks"]] == [2560, 2560]


def test_the_view_is_the_document_and_what_the_cli_prints_around_it(server):
    status, view = api(server, "view", README_QUERY + "&engine=vllm")
    assert status == 200
    assert view["plan"] == cli_json(README_EXAMPLE + ["--engine", "vllm"])
    _, text, _ = cli(["plan", *README_EXAMPLE, "--engine", "vllm"])
    lines = text.splitlines()
    # the commands to paste, as the CLI prints them
    assert view["commands"][0]["shell"] == lines[lines.index("vllm command:") + 1]
    plugin = lines.index("vllm command with kvmem's plugin (per-rank budgets):")
    assert view["commands"][1]["shell"] == lines[plugin + 1]
    # every note and the fit error the CLI prints, in the same words
    for warning in view["warnings"]:
        assert warning.split(";")[0] in text
    assert any("longest max_model_len that fits is 40,944" in w for w in view["warnings"])
    for term, value in view["summary"]:
        assert re.search(rf"^{re.escape(term)} +{re.escape(value)}$", text, re.M)
    # each rank's bar: the --plot figures, stacking up to what the rank uses
    ranks = view["plan"]["ranks"]
    for bar, rank in zip(view["bars"]["ranks"], ranks, strict=True):
        kv = bar["gib"][[p["label"] for p in view["bars"]["parts"]].index("KV cache")]
        assert kv == pytest.approx(rank["kv_budget_bytes"] / (1 << 30), abs=1e-3)
        assert bar["memory_gib"] is None  # no GPU given: the bar has no device line
    _, crowded = api(server, "view", "model=meta-llama/Llama-3.1-70B-Instruct&gpu=L40S&tp=2")
    bar, rank = crowded["bars"]["ranks"][0], crowded["plan"]["ranks"][0]
    assert bar["memory_gib"] == pytest.approx(rank["memory_bytes"] / (1 << 30), abs=1e-3)
    assert sum(bar["gib"]) > bar["memory_gib"]  # its weights alone exceed the device
    assert view["vllm_log"] == ("GPU KV cache size: 40,960 tokens, Maximum concurrency for "
                                "40,960 tokens per request: 1.00x")


# (query, the same flags on the command line, the field the page shows the error beside)
BAD = [
    ("model=qwen3-32b&pp=0", ["qwen3-32b", "--pp", "0"], "pp"),
    ("model=qwen3-32b&tp=x", ["qwen3-32b", "--tp", "x"], "tp"),
    ("model=qwen3-32b&tp=3&gpu=H100", ["qwen3-32b", "--tp", "3", "--gpu", "H100"], "tp"),
    # a layout is checked before anything is sized per rank (not a list of 10^12 GPUs)
    ("model=qwen3-32b&pp=1000&gpu=H100", ["qwen3-32b", "--pp", "1000", "--gpu", "H100"], "pp"),
    ("model=qwen3-32b&pp=2&layer_partition=60,8&gpu=H100",
     ["qwen3-32b", "--pp", "2", "--layer-partition", "60,8", "--gpu", "H100"],
     "layer_partition"),
    ("model=qwen3-32b&pp=2&layer_partition=a,b&gpu=H100",
     ["qwen3-32b", "--pp", "2", "--layer-partition", "a,b", "--gpu", "H100"], "layer_partition"),
    ("model=qwen3-32b&gpu=H1000", ["qwen3-32b", "--gpu", "H1000"], "gpu"),
    ("model=qwen3-32b&gpu_memory=-4", ["qwen3-32b", "--gpu-memory", "-4"], "gpu_memory"),
    ("model=qwen3-32b&kv_cache_memory_bytes=5+parsecs",
     ["qwen3-32b", "--kv-cache-memory-bytes", "5 parsecs"], "kv_cache_memory_bytes"),
    ("model=qwen3-32b&gpu=H100&kv_cache_dtype=int3",
     ["qwen3-32b", "--gpu", "H100", "--kv-cache-dtype", "int3"], "kv_cache_dtype"),
    ("model=qwen3-32b&gpu=H100&gpu_memory_utilization=1.5",
     ["qwen3-32b", "--gpu", "H100", "--gpu-memory-utilization", "1.5"],
     "gpu_memory_utilization"),
    ("model=qwen3-32b&gpu=H100&block_size=-16",
     ["qwen3-32b", "--gpu", "H100", "--block-size", "-16"], "block_size"),
    ("model=qwen3-32b&gpu=H100&max_num_seqs=0",
     ["qwen3-32b", "--gpu", "H100", "--max-num-seqs", "0"], "max_num_seqs"),
    ("model=qwen3-32b&gpu=H100&kv_budget=best",
     ["qwen3-32b", "--gpu", "H100", "--kv-budget", "best"], "kv_budget"),
    ("model=qwen3-32b&gpu=H100&cpu_offload_gib=-1",
     ["qwen3-32b", "--gpu", "H100", "--cpu-offload-gib", "-1"], "cpu_offload_gib"),
    ("model=qwen3-32b&gpu=H100&weight_offload_gib=nan",
     ["qwen3-32b", "--gpu", "H100", "--weight-offload-gib", "nan"], "weight_offload_gib"),
    ("model=qwen3-32b&gpu=H100&kv_memory_limit=1GiB",
     ["qwen3-32b", "--gpu", "H100", "--kv-memory-limit", "1GiB"], "kv_memory_limit"),
    ("model=qwen3-32b&device=cpu", ["qwen3-32b", "--device", "cpu"], "device"),
    ("model=qwen3-32", ["qwen3-32", "--gpu", "H100"], "model"),
]


@pytest.mark.parametrize("query, argv, field", BAD)
def test_a_bad_value_is_the_cli_line_with_its_field(server, query, argv, field):
    status, body = api(server, "view", query)
    assert status == 400
    assert body == {"error": cli_error(argv), "field": field}
    assert api(server, "plan", query) == (400, body)


def test_odd_values_in_every_field_are_planned_or_refused_never_a_crash(server):
    odd = ["", "-1", "0", "1e400", "abc", "999999999999", "1.5", "nan", " 2", "1,2,3", "-",
           "inf", "-inf", "1e309", "0x10", "1_000", "\x00", "\u202e2", "\U0001f600", "9" * 5000,
           "H100," * 2000, '{"method": "mtp"}', '[' * 5000]
    for group in form()["groups"]:
        for field in group["fields"]:
            for value in odd + (field["choices"] or []):
                base = {"model": "qwen3-8b", "gpu": "H100", "engine": "vllm"}
                status, body = api(server, "view", urlencode({**base, field["name"]: value}))
                assert status in (200, 400), (field["name"], value, body)
                if status == 400:
                    assert body["error"] and "\n" not in body["error"]


@pytest.mark.parametrize("key", ["profile", "plot", "json", "check"])
def test_flags_for_the_terminal_are_refused(server, key):
    status, body = api(server, "plan", f"model=qwen3-8b&gpu=H100&{key}=/etc/passwd")
    assert status == 400
    assert body == {"error": f"{key!r} is for the command line (`kvmem plan`), not the page",
                    "field": None}


def test_an_unknown_key_is_named(server):
    assert api(server, "plan", "model=qwen3-8b&gpu=H100&tensor=2") == (
        400, {"error": "'tensor' is no flag of `kvmem plan`", "field": None})


def test_a_model_is_never_read_from_the_servers_files(server, tmp_path):
    """`kvmem plan DIR` reads DIR/config.json; the page takes only catalog names."""
    _, cfg = catalog_config("qwen3-8b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cli(["plan", str(tmp_path), "--gpu", "H100"])[0] == 0  # the CLI reads it
    status, body = api(server, "plan", f"model={quote(str(tmp_path))}&gpu=H100")
    assert status == 400 and body["field"] == "model"
    assert body["error"].startswith(f"unknown model {str(tmp_path)!r}")


def test_a_pasted_config_plans_like_its_file(server, tmp_path):
    _, cfg = catalog_config("qwen3-8b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    flags = ["--gpu", "H100", "--tp", "2", "--engine", "vllm"]
    expected = cli_json([str(tmp_path), *flags])
    query = urlencode({"config": json.dumps(cfg), "model": str(tmp_path), "gpu": "H100",
                       "tp": "2", "engine": "vllm"})
    status, doc = api(server, "plan", query)
    assert status == 200
    assert doc == expected  # the command names the model as given with the config


def test_a_pasted_config_without_a_name_is_model_in_the_command(server):
    _, cfg = catalog_config("qwen3-8b")
    cfg = {k: v for k, v in cfg.items() if k != "_name_or_path"}
    status, doc = api(server, "plan", urlencode({"config": json.dumps(cfg), "gpu": "H100",
                                                 "engine": "vllm"}))
    assert status == 200
    assert doc["model"] == "MODEL" and doc["engine_command"]["argv"][:3] == ["vllm", "serve",
                                                                            "MODEL"]


@pytest.mark.parametrize("config, match", [
    ("{", "config.json: not valid JSON"),
    ('{"hidden_size": 8}', "config.json is missing num_hidden_layers"),
    ("[1]", "config must be a JSON object"),
])
def test_a_bad_pasted_config_is_one_line_beside_it(server, config, match):
    status, body = api(server, "view", urlencode({"config": config, "gpu": "H100"}))
    assert status == 400 and body["field"] == "config" and match in body["error"]


def test_no_model_asks_for_one(server):
    status, body = api(server, "view", "gpu=H100")
    assert status == 400 and body["field"] == "model" and "catalog name" in body["error"]


def test_every_plan_flag_is_on_the_page_or_refused_by_name(server):
    """The form is `kvmem plan`'s parser: a flag added there shows up, or is refused
    in words when it is output or names a file."""
    on_page = {f["name"] for g in form()["groups"] for f in g["fields"]}
    for action in plan_parser()._actions:
        if action.dest in on_page:
            continue
        status, body = api(server, "plan", f"model=qwen3-8b&gpu=H100&{action.dest}=x")
        assert status == 400 and "for the command line" in body["error"], action.dest
    assert {"model", "tp", "pp", "layer_partition", "gpu", "gpu_memory", "max_model_len",
            "kv_cache_dtype", "block_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
            "kv_budget", "cpu_offload_gib", "disk_offload_gib", "engine"} <= on_page


def test_the_page_and_its_files_come_from_the_package_only(server):
    status, headers, html = get(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    for name in ("app.js", "app.css"):
        status, _, body = get(server, f"/static/{name}")
        assert status == 200
        # nothing from another host: no absolute URL a browser would fetch
        assert not re.search(rb"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", body), name
    assert not re.search(rb"(src|href)=\"(https?:)?//", html)
    for path in ("/static/../query.py", "/static/query.py", "/etc/passwd", "/api"):
        status, _, body = get(server, path)
        assert status == 404 and json.loads(body)["error"].startswith("no such page")


def test_other_methods_are_refused_in_one_line(server):
    request = urllib.request.Request(server.url + "api/plan?" + README_QUERY, data=b"{}",
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET, HEAD, OPTIONS"
    assert json.loads(refused.value.read())["error"].startswith("POST is not answered here")


def test_the_page_files_are_package_data():
    """A wheel carries exactly what pyproject names: every file the page needs matches."""
    line = re.search(r'^"kvmem\.ui" = (\[.*\])$', (ROOT / "pyproject.toml").read_text(), re.M)
    globs = json.loads(line.group(1))
    static = ROOT / "kvmem" / "ui" / "static"
    for path in static.iterdir():
        rel = path.relative_to(static.parent).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel
    from kvmem.ui import server as ui_server

    assert set(ui_server._STATIC) == {p.name for p in static.iterdir()}


def test_kvmem_ui_on_port_0_prints_its_url_and_serves():
    proc = subprocess.Popen([sys.executable, "-m", "kvmem", "ui", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        line = proc.stdout.readline()
        m = re.match(r"kvmem ui: (http://127\.0\.0\.1:(\d+)/)", line)
        assert m and int(m.group(2)) > 0, line + proc.stderr.read() if proc.poll() else line
        with urllib.request.urlopen(m.group(1) + "api/plan?" + README_QUERY, timeout=30) as r:
            assert json.loads(r.read())["engine"]["num_blocks"] == 2560
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_port_in_use_is_one_line(server):
    port = server.server_address[1]
    code, _, err = cli(["ui", "--port", str(port)])
    assert code == 2
    assert err.startswith(f"kvmem: error: cannot listen on 127.0.0.1:{port}")
    assert err.count("\n") == 1


def test_the_ui_imports_no_torch_engine_or_server():
    code = ("import sys, threading, urllib.request\n"
            "from kvmem.ui.server import UIServer\n"
            "s = UIServer('127.0.0.1', 0)\n"
            "threading.Thread(target=s.serve_forever, daemon=True).start()\n"
            "for p in ('', 'api/form', 'api/view?model=qwen3-8b&gpu=H100&engine=vllm'\n"
            "          '&kv_memory=elastic&cpu_offload_gib=2'):\n"
            "    urllib.request.urlopen(s.url + p, timeout=60).read()\n"
            "above = [m for m in sys.modules if m.startswith(('kvmem.engine', 'kvmem.serve'))]\n"
            "sys.exit(3 if 'torch' in sys.modules else 4 if above else 0)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr


# --- what one request may ask of the server (kvmem.ui.limits, kvmem.spec.bounds) -------------

def _llama(**fields) -> str:
    _, cfg = catalog_config("meta-llama/Llama-3.1-8B-Instruct")
    return json.dumps({**cfg, **fields})


@pytest.mark.parametrize("layers", [10**9, 10**6, 1e300])
def test_a_config_of_a_billion_layers_is_a_400_naming_the_field(server, layers):
    status, body = api(server, "plan", urlencode({"config": _llama(num_hidden_layers=layers)}))
    assert status == 400 and body["field"] == "config"
    assert "field 'num_hidden_layers' must be at most 1,024" in body["error"]


@pytest.mark.parametrize("field, value", [
    ("vocab_size", 10**12), ("hidden_size", 10**9), ("num_attention_heads", 10**7),
    ("max_position_embeddings", 10**15), ("sliding_window", 10**15),
    ("num_local_experts", 10**8), ("intermediate_size", 10**12),
    ("layer_types", ["full_attention"] * 1500),
])
def test_every_size_of_a_pasted_config_is_bounded(server, field, value):
    status, body = api(server, "plan", urlencode({"config": _llama(**{field: value})}))
    assert status == 400 and body["field"] == "config" and f"'{field}'" in body["error"]


@pytest.mark.parametrize("query, field", [
    ("tp=2048", "tp"), ("pp=5000", "pp"), ("tp=64&pp=32", "tp"),
    ("max_model_len=2147483648", "max_model_len"), ("block_size=1048576", "block_size"),
    ("max_num_seqs=99999999", "max_num_seqs"), ("max_concurrent_batches=5000",
                                                "max_concurrent_batches"),
])
def test_the_page_bounds_each_count_a_flag_takes(server, query, field):
    status, body = api(server, "plan", f"model=qwen3-8b&gpu=H100&{query}")
    assert status == 400 and body["field"] == field and "on this page" in body["error"] \
        or "the page plans at most" in body["error"]


def test_a_long_value_or_key_is_refused_short(server):
    status, body = api(server, "plan", "model=qwen3-8b&gpu=" + "H100," * 3000)
    assert status == 400 and body["field"] == "gpu" and "characters long" in body["error"]
    status, body = api(server, "plan", "model=qwen3-8b&" + "k" * 5000 + "=1")
    assert status == 400 and len(body["error"]) < 200 and "5,000 characters" in body["error"]
    status, body = api(server, "plan", "model=qwen3-8b&" + "k" * 300 + "=" + "1" * 9000)
    assert status == 400 and body["field"] is None and len(body["error"]) < 200


@pytest.mark.parametrize("config", ['{"a": ' + "9" * 5000 + "}", "[" * 100_00 + "]" * 100_00])
def test_a_config_python_cannot_read_is_refused_beside_it(server, config):
    status, body = api(server, "plan", urlencode({"config": config}))
    assert status == 400 and body["field"] == "config" and "not valid JSON" in body["error"]


def test_a_speculative_draft_is_never_read_from_the_servers_files(server, tmp_path):
    _, cfg = catalog_config("qwen3-0.6b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for draft in (str(tmp_path), str(tmp_path / "config.json"), "~", "a\x00b"):
        spec = json.dumps({"method": "eagle", "num_speculative_tokens": 1, "model": draft})
        status, body = api(server, "plan", urlencode({"model": "qwen3-8b", "gpu": "H100",
                                                      "speculative_config": spec}))
        assert status == 400 and body["field"] == "speculative_config", body
        assert "reads no file of the server" in body["error"]
    spec = json.dumps({"method": "eagle", "num_speculative_tokens": 1, "model": "qwen3-0.6b"})
    status, doc = api(server, "plan", urlencode({"model": "qwen3-8b", "gpu": "H100",
                                                 "speculative_config": spec}))
    assert status == 200, doc  # a catalog draft plans


def test_a_plan_past_the_deadline_is_refused_and_its_worker_replaced():
    from kvmem.ui.workers import PlanWorkers

    workers = PlanWorkers(count=1, seconds=3.0)
    try:
        slow = urlencode({"config": _llama(num_hidden_layers=1024), "pp": 2, "gpu": "H100",
                          "kv_budget": "optimal"})  # the search: a minute and more
        (first,) = workers._all
        outcome, (message, field) = workers.ask("plan", slow)
        assert outcome == "refused" and field is None
        assert message.startswith("this plan took longer than 3 s to compute")
        assert not first.process.is_alive()
        (second,) = workers._all
        assert second is not first and second.process.is_alive()
    finally:
        workers.close()


# --- connections: deadlines, a bound on their number, HEAD/OPTIONS, clients that go away ------

def test_a_disk_tier_directory_is_never_looked_up_on_the_server(server, tmp_path):
    """The page plans a disk tier by its size: whether a path exists on the server (a file,
    a directory, nothing) must not change the answer, or a remote user learns it."""
    a_file = tmp_path / "secret.txt"
    a_file.write_text("x")
    answers = []
    for path in (str(a_file), str(a_file / "below"), str(tmp_path), "/no/such/dir"):
        status, body = api(server, "plan", "model=llama-3.1-8b&gpu=H100&disk_offload_gib=1"
                           f"&disk_offload_dir={path}")
        assert status == 200, body
        assert body["kv_offload"]["disk"].pop("dir") == path  # named as given
        answers.append(body["kv_offload"])
    assert all(a == answers[0] for a in answers)
    # the command line, on the machine it runs on, still refuses a file
    code, _, err = cli(["plan", "llama-3.1-8b", "--gpu", "H100", "--disk-offload-gib", "1",
                        "--disk-offload-dir", str(a_file)])
    assert code == 2 and "is not a directory" in err


@pytest.fixture
def strict():
    """A server whose requests must arrive within 0.5 s, with at most 3 connections."""
    with serving(request_seconds=0.5, max_connections=3) as s:
        yield s


def _connect(server) -> socket.socket:
    return socket.create_connection(server.server_address[:2], timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (reading what it sends)."""
    end = time.monotonic() + seconds
    sock.settimeout(0.1)
    while time.monotonic() < end:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def test_a_half_sent_request_is_closed_after_the_deadline(strict):
    with _connect(strict) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for _ in range(8):  # a header line a while, never the end: no request ever completes
            time.sleep(0.15)
            with contextlib.suppress(OSError):
                sock.sendall(b"X-Slow: 1\r\n")
        assert _closed_within(sock, 3)


def test_an_idle_kept_alive_connection_is_closed(strict):
    with _connect(strict) as sock:
        sock.sendall(b"GET /api/form HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in sock.recv(200)
        assert _closed_within(sock, 3)


def test_connections_past_the_bound_are_answered_503_without_a_thread(strict):
    idle = [_connect(strict) for _ in range(3)]
    try:
        time.sleep(0.1)
        with _connect(strict) as extra:
            extra.sendall(b"GET /api/form HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = extra.recv(4096)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"\n" not in body
        assert "its most" in json.loads(body)["error"]
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.7)  # the idle ones are gone: served again
    assert get(strict, "/api/form")[0] == 200


def test_head_is_get_without_the_body_and_options_names_the_methods(server):
    for path in ("/", "/static/app.js", "/api/form", "/api/plan?" + README_QUERY, "/nowhere"):
        got = get(server, path)
        request = urllib.request.Request(server.url + path.lstrip("/"), method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                status, headers, body = r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            status, headers, body = e.code, dict(e.headers), e.read()
        assert (status, body) == (got[0], b"")
        assert headers["Content-Length"] == str(len(got[2]))
        assert headers["Content-Type"] == got[1]["Content-Type"]
    request = urllib.request.Request(server.url + "api/plan", method="OPTIONS")
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 204 and r.headers["Allow"] == "GET, HEAD, OPTIONS"


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", None),  # no version: answered as HTTP/0.9, a body alone
    (b"GET / HTTP/9.x\r\n\r\n", None),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"BREW / HTTP/1.1\r\nHost: x\r\n\r\n", 501),
])
def test_http_servers_own_refusals_are_one_line_of_json(server, raw, status):
    with _connect(server) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    if status is None:
        head, body = b"", answer
    else:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status}".encode())
    assert b"\n" not in body and json.loads(body)["error"] and b"<" not in body


def test_too_many_header_bytes_close_the_connection(server):
    with _connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        with contextlib.suppress(OSError):
            for _ in range(90):
                sock.sendall(b"X-Pad: " + b"a" * 2000 + b"\r\n")
        assert _closed_within(sock, 5)
    assert get(server, "/api/form")[0] == 200


def test_a_client_that_goes_away_logs_no_traceback(capfd):
    with serving(verbose=False) as s:
        for _ in range(5):
            with _connect(s) as sock:
                sock.sendall(f"GET /api/view?{README_QUERY} HTTP/1.1\r\nHost: x\r\n\r\n"
                             .encode())
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # closed with a reset before the answer: its write fails
        time.sleep(1.5)
        assert get(s, "/api/form")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err


def _kvmem_ui(*flags: str) -> tuple[str, str]:
    """`kvmem ui FLAGS --port 0`'s first line and what it wrote to stderr until stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "kvmem", "ui", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        time.sleep(0.5)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    return line, err


def test_listening_beyond_loopback_warns_in_one_line():
    line, err = _kvmem_ui("--host", "0.0.0.0")
    assert line.startswith("kvmem ui: http://0.0.0.0:")
    warnings = [w for w in err.splitlines() if "warning" in w]
    assert warnings == ["kvmem ui: warning: listening on 0.0.0.0, beyond this machine's "
                        "loopback; the page has no authentication: anyone who can reach this "
                        "port can use it"]
    assert "warning" not in _kvmem_ui("--host", "127.0.0.1")[1]


def test_a_pasted_config_of_any_shape_is_planned_or_refused_in_one_line(server):
    """Each field the loader reads, given a value of every JSON type: a ConfigError line
    (a 400 beside the config), never an exception of the loader's own."""
    from kvmem.errors import ConfigError
    from kvmem.spec import spec_from_config
    from kvmem.spec.bounds import BOUNDS, LAYER_LISTS

    odd = [None, True, -1, 0, 1.5, "x", "", [], ["x"], [1], {}, {"a": 1}, 1e300, float("nan"),
           10**30]
    keys = {*BOUNDS, *LAYER_LISTS, "architectures", "model_type", "torch_dtype", "text_config",
            "quantization_config", "tie_word_embeddings", "_name_or_path", "use_sliding_window"}
    for model in ("meta-llama/Llama-3.1-8B-Instruct", "google/gemma-3-4b-it"):
        _, cfg = catalog_config(model)
        for key in sorted(keys):
            for value in odd:
                try:
                    spec_from_config({**cfg, key: value}, "config.json")
                except ConfigError as e:
                    assert "\n" not in str(e)
    status, body = api(server, "plan", urlencode({"config": _llama(architectures=5)}))
    assert status == 400 and body["field"] == "config" and "'architectures'" in body["error"]


def test_only_a_server_bug_is_logged_with_its_traceback(capfd):
    with serving() as s:
        for gone in (BrokenPipeError(), ConnectionResetError(), TimeoutError(),
                     OSError(errno.EBADF, "Bad file descriptor")):  # closed as the process exits
            try:
                raise gone
            except OSError:
                s.handle_error(None, ("127.0.0.1", 1))
        try:
            raise ValueError("a bug")
        except ValueError:
            s.handle_error(None, ("127.0.0.1", 1))
    err = capfd.readouterr().err
    assert err.count("Traceback") == 1 and "ValueError: a bug" in err


def test_a_get_with_a_body_is_answered_once_and_closed(server):
    """Its body is never read, so it cannot be taken for the next request."""
    with _connect(server) as sock:
        sock.sendall(b"GET /api/form HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n\r\n"
                     b"GET /nowhere HTTP/1.1\r\n\r\n....")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1 ") == 1


def test_too_many_query_fields_are_one_line(server):
    status, body = api(server, "plan", "model=qwen3-8b&" + "&".join(["gpu=H100"] * 300))
    assert status == 400 and "Max number of fields exceeded" in body["error"]


def _serve_with_a_hog(conn, memory_bytes: int) -> None:
    """A plan worker with one more endpoint, which allocates the bytes its query names."""
    from kvmem.ui import view, workers

    view.ENDPOINTS["hog"] = lambda query: len(bytearray(int(query)))
    workers._serve(conn, memory_bytes)


def test_a_plan_worker_past_its_memory_cap_refuses_in_one_line_and_serves_on():
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    worker = context.Process(target=_serve_with_a_hog, args=(theirs, 1 << 30), daemon=True)
    worker.start()
    theirs.close()
    try:
        for size, answer in ((100 << 20, ("ok", 100 << 20)),
                             (3 << 30, ("refused", ("this plan needs more than 1.00 GiB of "
                                                    "memory to compute, the page's limit",
                                                    None))),
                             (1 << 20, ("ok", 1 << 20))):
            ours.send(("hog", str(size)))
            assert ours.poll(60) and ours.recv() == answer
    finally:
        ours.close()
        worker.join(timeout=30)
    assert worker.exitcode == 0  # its pipe closed, it ends
