"""kvmem's vLLM rules against vLLM's own functions, for vLLM 0.32 and 0.33, over a grid.

One subprocess per vLLM venv runs ``tests/vllm_kv_rules.py`` over every case: the KV
specs vLLM's attention layers build for each pipeline stage, and what vLLM's
``get_kv_cache_configs``, ``get_kv_cache_capacity`` and the specs'
``max_memory_usage_bytes`` make of them. Each case is planned here with
``kvmem.plan.plan`` under the same release's rules; the groups, each group's charge, each
stage's bytes per block and blocks, the engine's blocks, the logged KV cache size and
concurrency, the start-up check's need and its estimated longest length must be vLLM's.

The grid: Gemma-3-like (5 sliding : 1 full), gpt-oss-like (1 : 1, also 13 : 12), Llama-4-
like (3 chunked : 1 full) with the hybrid manager on and off, all-sliding, dense, MLA and
layers whose pages differ; windows shorter and longer than the request, chunk sizes,
max_model_len, max_num_batched_tokens, block sizes, asynchronous scheduling, pp 1 to 3.

The same subprocess asks vLLM's engine arguments which max_num_batched_tokens and
max_num_seqs ``vllm serve`` runs with when either is given or left to its CPU defaults, and
when it refuses them; ``kvmem plan`` must pick the same or refuse too.
"""

from __future__ import annotations

import json
import random
from functools import cache

import pytest
import vllm_cpu

from kvmem.plan import EngineSettings, Layout, RankProfile, plan
from kvmem.plan.estimates import vllm_batch_limits, vllm_cpu_defaults
from kvmem.plan.partition import even_partition, stage_layers
from kvmem.plan.planner import engine_geometry
from kvmem.spec import AttentionKind, LayerKV, ModelSpec
from kvmem.spec.layout import Speculative

pytestmark = [pytest.mark.vllm]

SERIES = ("0.32", "0.33")
KINDS = {"full": AttentionKind.FULL, "sliding": AttentionKind.SLIDING,
         "chunked": AttentionKind.CHUNKED, "mla": AttentionKind.MLA}
SPEC_CLASSES = {"full": "FullAttentionSpec", "sliding": "SlidingWindowSpec",
                "chunked": "ChunkedLocalAttentionSpec", "mla": "MLAAttentionSpec"}


def pattern(name: str, n: int, window: int) -> list[list]:
    """(kind, window[, head_dim]) of each layer."""
    if name == "gemma":
        return [["full", None] if (i + 1) % 6 == 0 else ["sliding", window] for i in range(n)]
    if name == "alternate":
        return [["sliding", window] if i % 2 == 0 else ["full", None] for i in range(n)]
    if name == "llama4":
        return [["full", None] if (i + 1) % 4 == 0 else ["chunked", window] for i in range(n)]
    if name == "mistral":
        return [["sliding", window]] * n
    if name == "mla":
        return [["mla", None]] * n
    if name == "pages":  # the sliding layers' pages are half the full layers'
        return [["full", None, 64] if (i + 1) % 3 == 0 else ["sliding", window, 32]
                for i in range(n)]
    return [["full", None]] * n


def model_spec(case: dict) -> ModelSpec:
    """The case's model: its layers (a KV-sharing layer reads ``kv_sources``' layer; an
    ``indexed`` layer carries DeepSeek V3.2's indexer cache), then a draft's."""
    sources = {int(k): v for k, v in case.get("kv_sources", {}).items()}
    indexed = set(case.get("indexed", ()))
    sparse = bool(indexed) or case.get("kv_dtype") == "fp8_ds_mla"
    index_bytes = case.get("index_head_dim", 0) + case.get("index_head_dim", 0) // 128 * 4
    layers = []
    for i, (kind, window, *head_dim) in enumerate(case["layers"]):
        dim = head_dim[0] if head_dim else case["head_dim"]
        layers.append(LayerKV(i, KINDS[kind], case["heads"], dim, window=window,
                              latent_dim=case["latent"] if kind == "mla" else 0,
                              kv_source=sources.get(i), sparse=sparse and kind == "mla",
                              index_bytes=index_bytes if i in indexed else 0))
    n = case.get("num_target", len(layers))
    draft = case.get("speculative")
    return ModelSpec(name="grid", architecture="Grid", model_type="grid",
                     num_layers=n, hidden_size=64, num_attention_heads=4,
                     num_kv_heads=case["heads"], head_dim=case["head_dim"],
                     intermediate_size=128, vocab_size=320, tie_word_embeddings=False,
                     dtype="float32", max_position_embeddings=None, layers=tuple(layers[:n]),
                     speculative=draft and Speculative(draft["method"], draft["tokens"],
                                                       tuple(layers[n:]), draft["mtp_layers"]))


def planned(case: dict, series: str, memory: list[int]):
    """kvmem's plan of the case under vLLM ``series``'s rules, each worker holding
    ``memory`` of KV (as the plugin plans a running vLLM)."""
    n = case.get("num_target", len(case["layers"]))
    partition = [len([i for i in s if i < n]) for s in case["stages"]]
    return plan(model_spec(case), Layout(pipeline_parallel_size=len(partition),
                                         layer_partition=partition),
                EngineSettings(gpu_memory_utilization=1.0, block_size=case["block_size"],
                               max_model_len=case["max_model_len"], max_num_seqs=256,
                               max_num_batched_tokens=case["batched"], cuda_graphs=False,
                               vllm_version=series,
                               device="gpu" if case["async"] else "cpu",
                               # the script builds the specs at the case's block size: on
                               # the CPU, as vLLM's platform leaves an MLA model's on AMX
                               # (its reference kernel's blocks of 16: the CPU MLA test)
                               cpu_amx=True,
                               hybrid_kv_cache_manager=case.get("hybrid"),
                               kv_cache_dtype="auto" if case.get("kv_dtype", "auto") == "auto"
                               else "fp8"),
                profile=[RankProfile(0, 0, 0, 0, m) for m in memory], suggest=False)


@cache
def grid() -> list[dict]:
    rng = random.Random(40)
    shapes = [("gemma", 6), ("gemma", 12), ("gemma", 26), ("gemma", 62), ("alternate", 24),
              ("alternate", 25), ("llama4", 8), ("llama4", 48), ("mistral", 8),
              ("dense", 10), ("mla", 7), ("pages", 9)]
    cases = []
    for shape, n in shapes:
        for _ in range(8):
            window = rng.choice([60, 128, 4096] if shape != "llama4" else [64, 8192])
            pp = rng.choice([p for p in (1, 2, 3) if p <= n])
            case = {"layers": pattern(shape, n, window), "heads": 2, "head_dim": 32,
                    "latent": 72, "block_size": rng.choice([16, 128]),
                    "max_model_len": rng.choice([96, 1000, 2048, 5000]),
                    "batched": rng.choice([64, 512, 2048]), "async": rng.random() < 0.5,
                    "stages": [list(r) for r in stage_layers(even_partition(n, pp))]}
            if shape == "llama4":  # vLLM turns the manager off for such models by default
                case["hybrid"] = rng.random() < 0.7
            cases.append(case)
    for case in cases:  # enough KV memory for one request on every stage, and more
        need = [r.need_bytes_at_max_model_len
                for r in planned(case, SERIES[-1], [1] * len(case["stages"])).ranks]
        case["memory"] = [int(x * rng.uniform(1.0, 4.0)) + rng.randrange(5000) for x in need]
    return cases


def kind_case(shape: str, rng: random.Random) -> dict:
    """One case of a KV kind beyond the grid's: KV shared across layers (Gemma 3n, Gemma
    4), DeepSeek V3.2's indexer with bf16-like or fp8_ds_mla latents, dense MLA in fp8, and
    speculative drafts (MTP modules, an EAGLE3 layer) with their lookahead."""
    case = {"heads": 2, "head_dim": 32, "latent": 72, "block_size": rng.choice([16, 64]),
            "max_model_len": rng.choice([96, 1000, 5000]),
            "batched": rng.choice([64, 512]), "async": rng.random() < 0.5}
    draft: list[list] = []
    if shape == "gemma3n":  # 4 sliding : 1 full, the last 5 read layers 8 (sliding) and 9
        layers = [["full", None] if (i + 1) % 5 == 0 else ["sliding", 60] for i in range(15)]
        case["kv_sources"] = {str(i): 9 if layers[i][0] == "full" else 8 for i in range(10, 15)}
    elif shape == "gemma4":  # 5 : 1, full layers with twice the head size, last 4 shared
        layers = [["full", None, 64] if (i + 1) % 6 == 0 else ["sliding", 128, 32]
                  for i in range(12)]
        case["kv_sources"] = {str(i): 5 if layers[i][0] == "full" else 7 for i in range(8, 12)}
    elif shape in ("ds32", "ds32-eagle"):  # an indexer on every layer, or on every other
        layers = [["mla", None]] * 7
        step = rng.choice([1, 2])
        case.update(index_head_dim=128, indexed=list(range(0, 7, step)),
                    kv_dtype=rng.choice(["auto", "fp8_ds_mla"]))
        # every GPU runs sparse MLA and its indexer on kernels of 64 tokens
        # (kvmem.plan.vllm_backends): blocks of 64 and 256
        case["block_size"] *= 4
        if shape == "ds32":
            n = rng.choice([1, 2])
            draft = [["mla", None]] * n
            case["indexed"] += list(range(7, 7 + n))  # MTP layers always index
            case["speculative"] = {"method": "mtp", "tokens": rng.choice([1, 3]),
                                   "mtp_layers": n}
        else:
            draft = [["full", None, 64]]
            case["speculative"] = {"method": "eagle3", "tokens": 3, "mtp_layers": 1}
    elif shape == "mla-fp8":
        layers, case["kv_dtype"] = [["mla", None]] * 7, "fp8"
    elif shape == "gpt-oss-eagle3":  # sliding 128 and full in turn, an EAGLE3 full layer
        layers = [["sliding", 128] if i % 2 == 0 else ["full", None] for i in range(8)]
        draft = [["full", None, 64]]
        case["speculative"] = {"method": "eagle3", "tokens": rng.choice([1, 4]),
                               "mtp_layers": 1}
    else:  # "mtp-hybrid": Gemma-3-like with chained MTP modules of its full layers' shape
        layers = [["full", None] if (i + 1) % 6 == 0 else ["sliding", 60] for i in range(12)]
        draft = [["full", None]] * 3
        case["speculative"] = {"method": "mtp", "tokens": rng.choice([2, 3]), "mtp_layers": 3}
    n = len(layers)
    # vLLM refuses a stage that holds only KV-sharing layers (no KV of its own: "KV cache
    # layout LBHNC cannot express this model's mixed page sizes ([])"), as three stages of
    # these Gemma shapes would
    pp = rng.choice([1, 2] if "kv_sources" in case else [1, 2, 3])
    stages = [list(r) for r in stage_layers(even_partition(n, pp))]
    stages[-1] += range(n, n + len(draft))  # vLLM builds the drafter on the last rank
    case.update(layers=layers + draft, num_target=n, stages=stages)
    return case


KIND_SHAPES = ("gemma3n", "gemma4", "ds32", "ds32-eagle", "mla-fp8", "gpt-oss-eagle3",
               "mtp-hybrid")


@cache
def kinds_grid() -> list[dict]:
    rng = random.Random(49)
    cases = [kind_case(shape, rng) for shape in KIND_SHAPES for _ in range(4)]
    for case in cases:
        need = [r.need_bytes_at_max_model_len
                for r in planned(case, SERIES[-1], [1] * len(case["stages"])).ranks]
        case["memory"] = [int(x * rng.uniform(1.0, 4.0)) + rng.randrange(5000) for x in need]
    return cases


@pytest.mark.parametrize("index", range(4 * len(KIND_SHAPES)))
def test_kvmem_follows_vllm_for_shared_indexed_fp8_and_draft_kv(vllm_rules, index):
    """KV sharing, the indexer, fp8 latents and draft layers against vLLM's functions."""
    series, results = vllm_rules
    check_case(series, kinds_grid()[index], results["cases"][len(grid()) + index])


def test_the_kinds_grid_covers_each_rule():
    cases = kinds_grid()
    assert {c.get("kv_dtype") for c in cases} >= {"auto", "fp8", "fp8_ds_mla"}
    assert {len(c["stages"]) for c in cases if "speculative" in c} == {1, 2, 3}
    chained = [c for c in cases if c.get("speculative", {}).get("method") == "mtp"
               and min(c["speculative"]["tokens"], c["speculative"]["mtp_layers"]) > 1]
    assert any(kind == "sliding" for c in chained for kind, *_ in c["layers"])
    assert any(i not in c["indexed"] for c in cases if "indexed" in c
               for i in range(c["num_target"]))  # a layer without an indexer


# (max_model_len, max_num_batched_tokens, max_num_seqs, pp); None: vLLM's default
BATCH_CASES = [
    (96, 64, None, 1),  # tests/test_plan_vllm_live.py's short start, planned without seqs
    (96, 64, 8, 1), (96, 64, 128, 1), (2048, 100, None, 2),
    (8, None, 4, 1), (8, None, None, 1), (1024, None, None, 2), (1024, None, 4096, 1),
]


@pytest.fixture(scope="module", params=SERIES)
def vllm_rules(request, tmp_path_factory) -> tuple[str, dict]:
    cases_file = tmp_path_factory.mktemp("rules") / "cases.json"
    batch = [dict(zip(("max_model_len", "batched", "seqs", "pp"), c, strict=True))
             for c in BATCH_CASES]
    cases_file.write_text(json.dumps({"kv": grid() + kinds_grid(), "batch": batch}))
    script = (vllm_cpu.REPO / "tests" / "vllm_kv_rules.py").read_text()
    result = vllm_cpu.run_for_json(script, "KVMEM_RULES", str(vllm_cpu.model_dir()),
                                   str(cases_file), series=request.param, timeout=600)
    return request.param, result


def test_the_grid_covers_what_the_rules_distinguish():
    cases = grid()
    assert len(cases) == 96
    windows = [(w, c["max_model_len"], c["batched"]) for c in cases
               for kind, w, *_ in c["layers"] if kind == "sliding"]
    assert any(w > length for w, length, _ in windows)  # a window longer than the request
    assert any(w - 1 + b >= length > w for w, length, b in windows)  # capped by the request
    assert any(w - 1 + b < length for w, length, b in windows)
    assert {len(c["stages"]) for c in cases} == {1, 2, 3}
    assert {c["async"] for c in cases} == {True, False}
    assert {c.get("hybrid") for c in cases if c["layers"][0][0] == "chunked"} == {True, False}


def group_class(geometry, group, indexed: set[int]) -> str:
    """The class of vLLM's spec for a kvmem group: one layer spec for all, else (latent
    attention with its indexer, layers of one type with different pages) the wrapper."""
    if len({geometry.specs[i] for i in group.layers}) > 1 or indexed & set(group.layers):
        return "UniformTypeKVCacheSpecs"
    return SPEC_CLASSES[group.kind]


def vllm_group(got_group: list) -> list:
    """A vLLM group with its layers once each (an indexer names its layer again)."""
    return [got_group[0], list(dict.fromkeys(got_group[1]))]


@pytest.mark.parametrize("index", range(96))
def test_kvmem_follows_vllms_own_functions(vllm_rules, index):
    series, results = vllm_rules
    check_case(series, grid()[index], results["cases"][index])


def check_case(series: str, case: dict, got: dict) -> None:
    """kvmem's plan of ``case`` against what vLLM's functions made of it (``got``)."""
    assert "traceback" not in got, got["traceback"]
    p = planned(case, series, case["memory"])
    spec = model_spec(case)
    geometry = engine_geometry(spec, 1, len(case["stages"]), p.settings, p.engine.kv_dtype)
    indexed = set(case.get("indexed", ()))
    groups = [[group_class(geometry, g, indexed), list(g.layers)]
              for g in geometry.global_groups]
    assert groups == [vllm_group(g) for g in got["groups"]]
    assert [geometry.lookahead_tokens, geometry.extra_retained_tokens] == [
        got["lookahead"][0], max(0, got["lookahead"][1] - 1)]
    assert [geometry.charge(g, case["max_model_len"]) for g in geometry.global_groups] \
        == got["charges"]
    assert geometry.concurrent_batches == got["max_concurrent_batches"]
    assert [r.bytes_per_block for r in p.ranks] == got["bytes_per_block"]
    assert [r.num_blocks for r in p.ranks] == got["worker_blocks"]
    assert [p.engine.num_blocks] * len(p.ranks) == got["num_blocks"]
    assert (p.engine.kv_cache_size_tokens, p.engine.max_concurrency) == (
        got["tokens"], got["concurrency"])
    assert [r.need_bytes_at_max_model_len - r.bytes_per_block for r in p.ranks] \
        == got["need"]
    assert p.engine.fits
    # one byte short of the need on the first stage: vLLM refuses, and so does the plan,
    # with vLLM's estimate of the longest length that fits
    short = planned(case, series, [r.need_bytes_at_max_model_len - 1 if r.rank == 0
                                   else r.need_bytes_at_max_model_len for r in p.ranks])
    assert not short.ranks[0].fits and all(r.fits for r in short.ranks[1:])
    assert "KV cache is needed, which is larger than the available KV cache memory" \
        in got["short_of_need"]
    longest = short.ranks[0].max_model_len_that_fits
    assert (f"the estimated maximum model length is {longest}." in got["short_of_need"]) \
        == (longest > 0)


@pytest.mark.parametrize("index", range(len(BATCH_CASES)))
def test_batch_limits_are_vllms(vllm_rules, index):
    """A defaulted max_num_seqs is lowered to the token budget and a defaulted budget to
    max_num_seqs x max_model_len, as vLLM's engine arguments do; where a max_num_seqs given
    stays above the budget, vLLM refuses to start and kvmem plan does too."""
    max_len, batched, seqs, pp = BATCH_CASES[index]
    got = vllm_rules[1]["batch_limits"][index]
    want = vllm_batch_limits(batched, seqs, vllm_cpu_defaults(None, pp)[1:], max_len)
    if want[0] < want[1]:
        assert "must be greater than or equal to max_num_seqs" in got["refused"], got
    else:
        assert (got["batched"], got["seqs"]) == want, got


def test_the_batch_cases_cover_each_limit_fitted_and_refused():
    limits = [(vllm_batch_limits(b, s, vllm_cpu_defaults(None, pp)[1:], n), b, s)
              for n, b, s, pp in BATCH_CASES]
    assert any(s is None and got[1] < 128 for got, b, s in limits)  # seqs lowered
    assert any(b is None and got[0] < 2048 for got, b, s in limits)  # budget lowered
    assert any(got[0] < got[1] and b is None for got, b, s in limits)  # refused, budget
    assert any(got[0] < got[1] and b is not None for got, b, s in limits)  # refused, given


CPU_MLA = r"""
import json, sys, tempfile
from pathlib import Path

sys.path.insert(0, sys.argv[3])
from vllm_kv_rules import cpu_platform

cpu_platform()
import torch
import vllm
from vllm.engine.arg_utils import EngineArgs

out = {"vllm": vllm.__version__, "amx": bool(torch.cpu._is_amx_tile_supported())}
with tempfile.TemporaryDirectory() as model:
    Path(model, "config.json").write_text(sys.argv[1])
    config = EngineArgs(model=model, tokenizer=sys.argv[2], skip_tokenizer_init=True,
                        block_size=128, kv_cache_memory_bytes=1 << 30, max_model_len=4096,
                        enable_prefix_caching=True).create_engine_config()
    out.update(block_size=config.cache_config.block_size,
               prefix_caching=bool(config.cache_config.enable_prefix_caching),
               chunked_prefill=bool(config.scheduler_config.enable_chunked_prefill))
print("KVMEM_CPU_MLA " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("series", SERIES)
def test_vllm_cpus_platform_sets_an_mla_models_blocks_as_kvmem_plans_them(series):
    """vLLM's CPU platform (``CpuPlatform.check_and_update_config``) on a small DeepSeek V3
    asked for blocks of 128 and prefix caching: its reference MLA kernel (no AMX) takes
    blocks of 16 and neither prefix caching nor chunked prefill; its AMX kernel keeps both.
    kvmem's plan for this host says the same."""
    from kvmem.spec import spec_from_config
    from tests.test_plan import DEEPSEEK_SMALL

    got = vllm_cpu.run_for_json(CPU_MLA, "KVMEM_CPU_MLA", json.dumps(DEEPSEEK_SMALL),
                                str(vllm_cpu.model_dir()), str(vllm_cpu.REPO / "tests"),
                                series=series, timeout=300)
    p = plan(spec_from_config(DEEPSEEK_SMALL, "ds"), Layout(),
             EngineSettings(kv_cache_memory_bytes=1 << 30, max_model_len=4096, block_size=128,
                            vllm_version=series, device="cpu"), suggest=False)
    assert p.engine.block_size == got["block_size"] == (128 if got["amx"] else 16)
    reference = any("reference kernel" in n and "prefix caching and chunked prefill off" in n
                    for n in p.notes)
    assert reference == (not got["prefix_caching"]) == (not got["chunked_prefill"]) \
        == (not got["amx"])
