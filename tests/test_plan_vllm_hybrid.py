"""kvmem's vLLM rules for linear-attention hybrids against vLLM's own, 0.32 and 0.33.

One subprocess per vLLM venv runs ``tests/vllm_hybrid_rules.py`` over a grid of tiny
Qwen3-Next-shaped (Gated DeltaNet 3 : 1 full attention), Nemotron-H-shaped (Mamba2,
attention and MLP layers), LFM2-shaped (short convolutions 2 : 1 full attention) and
Kimi-Linear-shaped (Kimi Delta Attention layers and MLA layers, "gpu" only) configs: vLLM's
engine arguments read each as a model, its platform raises the attention block size to
hold a state page, and its KV cache functions group, size, charge and check the layers.
Each case is planned here under the same release's rules from the same config; the
attention block size, the state page, the groups, each group's charge, each stage's bytes
per block, the engine's blocks, the logged KV cache size and concurrency, the start-up
check's need and its estimate of the longest length that fits must be vLLM's.

The grid: tp 1 and 2, pp 1 and 2, a bfloat16 or float32 model with its own or fp8 KV,
prefix caching on ("align") and off ("none"), vLLM's CPU attention and FlashAttention's
kernel blocks, Mamba2 groups that tp does not divide, block sizes below and above the raise.
"""

from __future__ import annotations

import json
import random
from functools import cache

import pytest
import vllm_cpu

from kvmem.errors import ConfigError
from kvmem.plan import EngineSettings, Layout, RankProfile, plan
from kvmem.plan.partition import even_partition, stage_layers
from kvmem.plan.planner import engine_geometry
from kvmem.plan.vllm_mamba import MAMBA
from kvmem.spec import spec_from_config
from tests.tiny_models import tiny_kimi_linear, tiny_lfm2, tiny_nemotron_h, tiny_qwen3_next

pytestmark = [pytest.mark.vllm]

SERIES = ("0.32", "0.33")
SPEC_CLASSES = {"full": "FullAttentionSpec", "mla": "MLAAttentionSpec", MAMBA: "MambaSpec"}
SHAPES = ("gdn", "mamba2", "short_conv", "kda")


def layer_kinds(config: dict) -> list[str]:
    """"full", "linear" or "none" for each layer (the script builds specs from these)."""
    if config["model_type"] == "nemotron_h":
        return [{"M": "linear", "*": "full"}.get(c, "none")
                for c in config["hybrid_override_pattern"]]
    if config["model_type"] == "kimi_linear":
        return ["linear" if i + 1 in config["linear_attn_config"]["kda_layers"] else "full"
                for i in range(config["num_hidden_layers"])]
    if config["model_type"] == "lfm2":
        return ["full" if t == "full_attention" else "linear" for t in config["layer_types"]]
    step = config["full_attention_interval"]
    return ["full" if (i + 1) % step == 0 else "linear"
            for i in range(config["num_hidden_layers"])]


def planned(case: dict, series: str, memory: list[int]):
    """kvmem's plan of the case under vLLM ``series``'s rules, each stage's workers holding
    ``memory`` of KV."""
    partition = [len(s) for s in case["stages"]]
    tp, ring = case["tp"], case.get("replayssm")
    return plan(spec_from_config(case["config"], "hybrid"),
                Layout(tensor_parallel_size=tp, pipeline_parallel_size=len(partition),
                       layer_partition=partition),
                EngineSettings(gpu_memory_utilization=1.0, block_size=case["block_size"],
                               max_model_len=case["max_model_len"], max_num_seqs=256,
                               max_num_batched_tokens=case["batched"], cuda_graphs=False,
                               vllm_version=series, device=case["device"],
                               kv_cache_dtype=case["kv_dtype"],
                               enable_prefix_caching=case["prefix_caching"],
                               replayssm_buffer_len=ring["buffer_len"] if ring else None,
                               mamba_backend=ring["backend"] if ring else "triton"),
                profile=[RankProfile(0, 0, 0, 0, m) for m in memory for _ in range(tp)],
                suggest=False)


def tiny_config(shape: str, dtype: str, rng: random.Random) -> dict:
    if shape == "kda":
        return tiny_kimi_linear(dtype, rng.choice([2, 4]))
    if shape == "gdn":
        return tiny_qwen3_next(rng.choice([8, 12]), dtype)
    if shape == "mamba2":
        return tiny_nemotron_h(dtype, rng.choice([1, 2]))
    return tiny_lfm2(dtype)


@cache
def grid() -> list[dict]:
    rng = random.Random(49)
    cases = []
    for shape in SHAPES:
        for k in range(16):
            dtype = rng.choice(["bfloat16", "float32"])
            config = tiny_config(shape, dtype, rng)
            n = config["num_hidden_layers"]
            pp = 1 + k % 2  # each of tp, pp, prefix caching and device half the cases
            case = {"id": len(cases), "config": config, "dtype": dtype,
                    "layers": layer_kinds(config), "tp": 1 + k // 2 % 2,
                    "prefix_caching": bool(k // 4 % 2),
                    # vLLM's CPU platform serves MLA without prefix caching: Kimi
                    # Linear's cases are on "gpu" (see vllm_hybrid_rules.py)
                    "device": "gpu" if shape == "kda" else ("cpu", "gpu")[k // 8 % 2],
                    "kv_dtype": rng.choice(["auto", "fp8"]),
                    "block_size": rng.choice([16, 32, 64, 1024]),
                    "max_model_len": rng.choice([96, 1000, 4096]),
                    "batched": rng.choice([512, 2048]),
                    "stages": [list(r) for r in stage_layers(even_partition(n, pp))]}
            cases.append(case)
    return with_memory(cases, rng)


def with_memory(cases: list[dict], rng: random.Random) -> list[dict]:
    for case in cases:  # enough KV memory for one request on every stage, and more
        ranks = planned(case, SERIES[-1], [1] * len(case["stages"])).ranks[::case["tp"]]
        case["memory"] = [int(r.need_bytes_at_max_model_len * rng.uniform(1.0, 4.0))
                          + rng.randrange(5000) for r in ranks]
    return cases


@cache
def replayssm_grid() -> list[dict]:
    """Nemotron-H with vLLM's --use-replayssm: Triton's ring of 16 and 32 (prefix caching
    on and off), FlashInfer's of 16 and 4 (off: FlashInfer's ReplaySSM has none), one or
    two Mamba2 groups at tp 1 and 2."""
    rng = random.Random(33)
    cases = []
    for k, (backend, buffer_len) in enumerate([("triton", 16), ("triton", 32),
                                               ("flashinfer", 16), ("flashinfer", 4)] * 2):
        dtype = rng.choice(["bfloat16", "float32"])
        config = tiny_nemotron_h(dtype, 1 + k % 2)
        pp = 1 + k // 4
        cases.append({"id": f"replayssm-{k}", "config": config, "dtype": dtype,
                      "layers": layer_kinds(config), "tp": 1 + k // 2 % 2,
                      "prefix_caching": backend == "triton" and k % 2 == 0,
                      "device": ("cpu", "gpu")[k % 2], "kv_dtype": "auto",
                      "block_size": rng.choice([16, 64]), "max_model_len": 1000,
                      "batched": 2048, "replayssm": {"buffer_len": buffer_len,
                                                     "backend": backend},
                      "stages": [list(r) for r in stage_layers(
                          even_partition(config["num_hidden_layers"], pp))]})
    return with_memory(cases, rng)


def vllms_rules(cases: list[dict], series: str, tmp_path_factory) -> dict:
    """vLLM ``series``'s own figures for ``cases`` (``tests/vllm_hybrid_rules.py``)."""
    cases_file = tmp_path_factory.mktemp("hybrid") / "cases.json"
    cases_file.write_text(json.dumps(cases))
    script = (vllm_cpu.REPO / "tests" / "vllm_hybrid_rules.py").read_text()
    return vllm_cpu.run_for_json(script, "KVMEM_HYBRID", str(vllm_cpu.REPO / "tests"),
                                 str(vllm_cpu.model_dir()), str(cases_file),
                                 series=series, timeout=600)


@pytest.fixture(scope="module", params=SERIES)
def vllm_hybrid(request, tmp_path_factory) -> tuple[str, dict]:
    # the --use-replayssm cases after the grid's, in the same run
    return request.param, vllms_rules(grid() + replayssm_grid(), request.param,
                                      tmp_path_factory)


def test_the_grid_covers_what_the_rules_distinguish():
    cases = grid()
    for key in ("tp", "prefix_caching", "device", "kv_dtype", "dtype"):
        for shape in ("qwen3_next", "nemotron_h", "lfm2", "kimi_linear"):
            if (shape, key) == ("kimi_linear", "device"):
                continue  # on "gpu" only (vllm_hybrid_rules.py says why)
            assert len({c[key] for c in cases if c["config"]["model_type"] == shape}) == 2, key
    assert {len(c["stages"]) for c in cases} == {1, 2}
    assert any(c["config"].get("n_groups") == 1 and c["tp"] == 2 for c in cases)
    # a --block-size below the raise and one above it
    assert {c["block_size"] for c in cases} >= {16, 1024}


@pytest.mark.parametrize("index", range(16 * len(SHAPES)))
def test_kvmem_follows_vllms_hybrid_rules(vllm_hybrid, index):
    series, results = vllm_hybrid
    assert_follows(grid()[index], results["cases"][index], series)


@pytest.mark.parametrize("index", range(len(replayssm_grid())))
def test_kvmem_follows_vllms_replayssm_rings(vllm_hybrid, index):
    """Where tp does not divide the Mamba2 groups, 0.32's ring fails to shape (vLLM's
    ``divide``) and kvmem refuses the plan; elsewhere the figures are vLLM's."""
    series, results = vllm_hybrid
    case, got = replayssm_grid()[index], results["cases"][len(grid()) + index]
    if series == "0.32" and case["config"]["n_groups"] % case["tp"]:
        assert "is not divisible by" in got.get("traceback", ""), got
        with pytest.raises(ConfigError, match="ReplaySSM cannot split the model's 1 Mamba2 "
                                              "groups across tensor parallel size 2"):
            planned(case, series, case["memory"])
        return
    assert_follows(case, got, series)


def assert_follows(case: dict, got: dict, series: str) -> None:
    """kvmem's plan of ``case`` under ``series``'s rules gives vLLM's own figures."""
    assert "traceback" not in got, got["traceback"]
    p = planned(case, series, case["memory"])
    geometry = engine_geometry(spec_from_config(case["config"], "hybrid"), case["tp"],
                               len(case["stages"]), p.settings, p.engine.kv_dtype)
    assert p.engine.block_size == got["block_size"]
    assert (geometry.mamba.state_bytes, geometry.mamba.page) == (got["state_bytes"],
                                                                 got["state_page"])
    assert geometry.mamba.cache_mode == got["mamba_cache_mode"]
    groups = [[SPEC_CLASSES[g.kind], list(g.layers)] for g in geometry.global_groups]
    assert groups == got["groups"]
    assert [geometry.charge(g, case["max_model_len"]) for g in geometry.global_groups] \
        == got["charges"]
    stages = p.ranks[::case["tp"]]  # every tensor-parallel rank of a stage is the same
    assert [r.bytes_per_block for r in stages] == got["bytes_per_block"]
    assert [p.engine.num_blocks] * len(stages) == got["num_blocks"]
    assert (p.engine.kv_cache_size_tokens, p.engine.max_concurrency) == (
        got["tokens"], got["concurrency"])
    assert [r.need_bytes_at_max_model_len - r.bytes_per_block for r in stages] \
        == got["need"]
    assert p.engine.fits
    short = planned(case, series, [r.need_bytes_at_max_model_len - 1 if r.rank == 0
                                   else r.need_bytes_at_max_model_len for r in stages])
    assert not short.ranks[0].fits and all(r.fits for r in short.ranks[case["tp"]:])
    assert "KV cache is needed, which is larger than the available KV cache memory" \
        in got["short_of_need"]
    longest = short.ranks[0].max_model_len_that_fits
    assert (f"the estimated maximum model length is {longest}." in got["short_of_need"]) \
        == (longest > 0)
