"""Property tests of kvmem.plan over random valid layouts (hypothesis)."""

import os
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.plan import GPU_MEMORY_GIB, EngineSettings, Layout, plan
from kvmem.spec import load_spec

MODELS = ["Qwen/Qwen3-8B", "meta-llama/Llama-3.2-3B-Instruct", "google/gemma-3-4b-it",
          "openai/gpt-oss-20b", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-Coder-Next",
          "mistralai/Mistral-7B-Instruct-v0.3", "Qwen/Qwen3-14B"]
SPECS = {m: load_spec(m) for m in MODELS}
GPUS = sorted(GPU_MEMORY_GIB)


def _valid_tp(spec):
    return [t for t in (1, 2, 4) if spec.num_attention_heads % t == 0
            and (spec.num_kv_heads % t == 0 or t % spec.num_kv_heads == 0)]


@st.composite
def deployments(draw):
    spec = SPECS[draw(st.sampled_from(MODELS))]
    tp = draw(st.sampled_from(_valid_tp(spec)))
    pp = draw(st.integers(1, 4))
    world = tp * pp
    gpus = draw(st.lists(st.sampled_from(GPUS), min_size=world, max_size=world))
    partition = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, spec.num_layers - 1), min_size=pp - 1,
                                    max_size=pp - 1, unique=True)))
        bounds = [0, *cuts, spec.num_layers]
        partition = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    engine = EngineSettings(
        gpu_memory_utilization=draw(st.sampled_from([0.5, 0.8, 0.9, 0.95, 1.0])),
        block_size=draw(st.sampled_from([1, 8, 16, 32])),
        max_model_len=draw(st.integers(1, 65536)),
        max_num_seqs=draw(st.sampled_from([1, 16, 256])),
        max_num_batched_tokens=draw(st.sampled_from([512, 2048, 8192])),
        cuda_graphs=draw(st.booleans()),
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8"])),
    )
    return spec, Layout(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        layer_partition=partition, gpus=gpus), engine


# KVMEM_PLAN_EXAMPLES=1000 for a longer search by hand
COMMON = dict(max_examples=int(os.environ.get("KVMEM_PLAN_EXAMPLES", 60)), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])


@settings(**COMMON)
@given(deployments(), st.sampled_from(["uniform", "proportional", "optimal"]))
def test_no_rank_holds_more_than_its_memory_allows(deployment, policy):
    spec, layout, engine = deployment
    p = plan(spec, layout, engine, policy=policy)
    for r in p.ranks:
        assert not r.over_committed
        assert r.kv_budget_bytes <= max(0, r.kv_capacity_bytes)
        assert r.non_kv_bytes + r.kv_budget_bytes <= max(r.budget_bytes, r.non_kv_bytes)
        if r.bytes_per_block:
            assert r.num_blocks * r.bytes_per_block <= r.kv_budget_bytes
        assert r.tokens <= max(r.num_blocks, 0) * p.engine.block_size  # the raised one
    assert p.engine.num_blocks <= min(r.num_blocks for r in p.ranks)


@settings(**COMMON)
@given(deployments())
def test_optimal_never_holds_fewer_tokens_than_uniform_or_proportional(deployment):
    spec, layout, engine = deployment
    best = plan(spec, layout, engine, policy="optimal").engine.tokens
    assert best >= plan(spec, layout, engine, policy="uniform").engine.tokens
    assert best >= plan(spec, layout, engine, policy="proportional").engine.tokens


@settings(**COMMON)
@given(deployments(), st.sampled_from(["uniform", "proportional", "optimal"]))
def test_stage_layers_cover_the_model_exactly_once(deployment, policy):
    spec, layout, engine = deployment
    p = plan(spec, layout, engine, policy=policy)
    stages = {}
    for r in p.ranks:
        stages.setdefault(r.pp_stage, r.layers)
        assert r.layers == stages[r.pp_stage]  # all tp ranks of a stage hold the same layers
        assert r.layers, "a stage is never empty"
    layers = [i for s in sorted(stages) for i in stages[s]]
    assert layers == list(range(spec.num_layers))
    assert sum(p.engine.layer_partition) == spec.num_layers


@settings(**COMMON)
@given(deployments(), st.integers(1, 64), st.booleans(),
       st.sampled_from(["uniform", "proportional", "optimal"]))
def test_no_rank_gets_more_than_a_stated_kv_cache_memory_bytes(deployment, gib, gpus, policy):
    spec, layout, engine = deployment
    value = gib << 30
    explicit = EngineSettings(**{**engine.__dict__, "kv_cache_memory_bytes": value})
    if not gpus:  # no GPU: the stated value alone limits
        layout = Layout(tensor_parallel_size=layout.tensor_parallel_size,
                        pipeline_parallel_size=layout.pipeline_parallel_size,
                        layer_partition=layout.layer_partition)
    p = plan(spec, layout, explicit, policy=policy)
    assert max(r.kv_budget_bytes for r in p.ranks) <= value
    if policy == "proportional":  # the value is one tensor-parallel column's total
        tp = layout.tensor_parallel_size
        for t in range(tp):
            assert sum(r.kv_budget_bytes for r in p.ranks if r.tp_rank == t) <= value


@settings(**COMMON)
@given(deployments(), st.integers(1, 64))
def test_optimal_holds_the_most_within_a_stated_value(deployment, gib):
    spec, layout, engine = deployment
    explicit = EngineSettings(**{**engine.__dict__, "kv_cache_memory_bytes": gib << 30})
    plain = Layout(tensor_parallel_size=layout.tensor_parallel_size,
                   pipeline_parallel_size=layout.pipeline_parallel_size,
                   layer_partition=layout.layer_partition)
    best = plan(spec, plain, explicit, policy="optimal").engine.tokens
    assert best >= plan(spec, plain, explicit, policy="uniform").engine.tokens
    assert best >= plan(spec, plain, explicit, policy="proportional").engine.tokens


def _exhaustive_best(spec, layout, engine):
    """Most engine blocks over every partition (each planned with optimal budgets)."""
    best = -1
    for cuts in combinations(range(1, spec.num_layers), layout.pipeline_parallel_size - 1):
        bounds = [0, *cuts, spec.num_layers]
        parts = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        fixed = Layout(**{**layout.__dict__, "layer_partition": parts})
        best = max(best, plan(spec, fixed, engine, policy="optimal",
                              suggest=False).engine.num_blocks)
    return best


GiB = 1 << 30


@pytest.mark.parametrize("model, tp, pp, gpus, kv_bytes, max_len", [
    ("google/gemma-3-4b-it", 1, 2, None, 2 * GiB, 32768),
    ("google/gemma-3-4b-it", 2, 2, ["L4", "L4", "A10G", "L4"], 2 * GiB, 32768),
    ("google/gemma-3-4b-it", 2, 2, ["L4", "T4", "V100-16GB", "L4"], GiB, 8192),
    ("google/gemma-3-4b-it", 1, 3, ["T4", "L4", "A10G"], None, 32768),
    ("openai/gpt-oss-20b", 1, 3, ["L4", "A10G", "L4"], 4 * GiB, 32768),
    ("openai/gpt-oss-20b", 1, 3, ["T4", "A100-80GB", "A10"], 8 * GiB, 32768),
    ("openai/gpt-oss-20b", 1, 3, ["RTX-4090", "A10G", "A100-40GB"], 16 * GiB, 32768),
    ("openai/gpt-oss-20b", 1, 3, None, 3 * GiB, 65536),
    ("openai/gpt-oss-20b", 1, 2, ["L4", "RTX-4090"], None, 32768),
    ("Qwen/Qwen3-Coder-Next", 2, 2, None, 8 * GiB, 32768),
    ("Qwen/Qwen3-14B", 1, 2, ["V100-16GB", "V100-32GB"], 3 * GiB, 32768),
    ("Qwen/Qwen3-8B", 1, 3, ["L4", "T4", "A10G"], None, 8192),
])
def test_optimal_matches_an_exhaustive_search_over_partitions(model, tp, pp, gpus, kv_bytes,
                                                              max_len):
    spec = SPECS.get(model) or load_spec(model)
    layout = Layout(tensor_parallel_size=tp, pipeline_parallel_size=pp, gpus=gpus)
    engine = EngineSettings(kv_cache_memory_bytes=kv_bytes, max_model_len=max_len)
    found = plan(spec, layout, engine, policy="optimal").engine.num_blocks
    assert found == _exhaustive_best(spec, layout, engine)


HYBRID = ["google/gemma-3-4b-it", "openai/gpt-oss-20b", "Qwen/Qwen3-Coder-Next"]


@settings(max_examples=int(os.environ.get("KVMEM_SEARCH_EXAMPLES", 12)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(HYBRID), st.sampled_from([1, 2]), st.sampled_from([2, 3]), st.data())
def test_optimal_matches_exhaustive_search_on_random_hybrid_deployments(model, tp, pp, data):
    spec = SPECS[model]
    gpus = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(GPUS), min_size=tp * pp,
                                                   max_size=tp * pp)))
    kv_bytes = data.draw(st.sampled_from([1, 2, 5, 16]).map(lambda g: g << 30)
                         if gpus is None else st.sampled_from([None, 1 << 30, 4 << 30]))
    layout = Layout(tensor_parallel_size=tp, pipeline_parallel_size=pp, gpus=gpus)
    engine = EngineSettings(kv_cache_memory_bytes=kv_bytes,
                            max_model_len=data.draw(st.sampled_from([4096, 32768])),
                            max_num_seqs=data.draw(st.sampled_from([16, 256])),
                            # kvmem's engine, or vLLM's rules (global groups since 0.11)
                            vllm_version=data.draw(st.sampled_from([None, "0.11", "0.33"])))
    found = plan(spec, layout, engine, policy="optimal").engine.num_blocks
    assert found == _exhaustive_best(spec, layout, engine)


@settings(**COMMON)
@given(deployments(), st.sampled_from(["uniform", "proportional", "optimal"]))
def test_a_fit_error_never_blames_an_empty_kv_budget(deployment, policy):
    """When non-KV memory leaves a rank no room, the message names that memory, never a
    'KV budget of 0 B' with a longest max_model_len of 0."""
    from kvmem.plan import FitError

    spec, layout, engine = deployment
    p = plan(spec, layout, engine, policy=policy)
    try:
        p.check_fit()
    except FitError as err:
        msg = str(err)
        assert "KV budget of 0 B" not in msg and "that fits is 0" not in msg
        assert msg.startswith("rank ")
