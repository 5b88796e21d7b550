"""Property tests of kvmem.plan over random valid layouts (hypothesis)."""

import os

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
            assert r.num_blocks * r.bytes_per_block + r.state_bytes_reserved \
                <= max(r.kv_budget_bytes, r.state_bytes_reserved)
        assert r.tokens <= max(r.num_blocks, 0) * engine.block_size
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
@given(deployments(), st.integers(1, 64))
def test_proportional_and_optimal_share_one_explicit_total(deployment, gib):
    spec, layout, engine = deployment
    explicit = EngineSettings(**{**engine.__dict__, "kv_cache_memory_bytes": gib << 30})
    plain = Layout(tensor_parallel_size=layout.tensor_parallel_size,
                   pipeline_parallel_size=layout.pipeline_parallel_size,
                   layer_partition=layout.layer_partition)  # no GPU: the total alone limits
    total = (gib << 30) * layout.world_size
    for policy in ("proportional", "optimal"):
        p = plan(spec, plain, explicit, policy=policy)
        assert sum(r.kv_budget_bytes for r in p.ranks) <= total
    uniform = plan(spec, plain, explicit, policy="uniform").engine.tokens
    assert plan(spec, plain, explicit, policy="optimal").engine.tokens >= uniform
