"""Qwen3-Next (Gated DeltaNet layers, gated full attention, MoE) and Qwen3.5 (the same
with unfused projections and a dense MLP) in kvmem's engine against transformers' on the
same random weights (fp32).

4-layer models (three Gated DeltaNet layers, one full-attention layer; the state groups
raise the block size to 32 tokens): greedy tokens equal transformers' with prefix
caching off and on (chunked prefill whose chunks end on block boundaries, a hit on a
state checkpoint), under preemption, and across tensor parallel 2 and pipeline
parallel 2.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import _randomize_norms, _write_tokenizer, tiny_qwen3_next

from kvmem.engine.llm import LLM
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import ConfigError
from kvmem.spec import AttentionKind, spec_from_config
from kvmem.spec.state_groups import engine_kv_groups, engine_layer_slots, state_block_size

NEW_TOKENS = 6
SHARED = [(i * 13) % 250 for i in range(40)]
LONG = [(i * 11 + 3) % 250 for i in range(100)]
PROMPTS = [SHARED + [1, 2, 3], [7, 3, 9], [(i * 7) % 250 for i in range(53)], LONG,
           SHARED + [4, 5], LONG[:96] + [9, 8]]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
       "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")


def make_checkpoint(tmp_path_factory, family: str):
    """(checkpoint directory, {prompt: transformers' greedy tokens}) of a tiny Qwen3-Next
    (MoE) or Qwen3.5 (``Qwen3_5ForCausalLM``: dense MLP, unfused projections)."""
    import transformers

    drop = ("architectures", "model_type", "torch_dtype", *(MOE if family == "qwen3_5" else ()))
    config = {k: v for k, v in tiny_qwen3_next(4, "float32").items() if k not in drop}
    config_cls, model_cls = {
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**config, initializer_range=0.1)).float().eval()
    _randomize_norms(model, 1)
    path = tmp_path_factory.mktemp(family) / f"tiny-{family}"
    model.save_pretrained(path)
    _write_tokenizer(path)
    return path, {tuple(p): hf_greedy(model, p) for p in PROMPTS}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "qwen3_next")


@torch.no_grad()
def hf_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy tokens from transformers' forward over the whole sequence at every step."""
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def check(llm: LLM, expected: dict, prompts: list[list[int]] = PROMPTS) -> None:
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [expected[tuple(p)] for p in prompts]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_tokens_match_transformers(checkpoint, prefix_caching):
    """A batch of mixed lengths in 40-token steps (prefills cross block boundaries; with
    prefix caching, chunks that do not finish a prompt end on one), then prompts that
    share 40 and 96 tokens with earlier ones: with prefix caching they start from the
    state checkpoints after one and two blocks, where the earlier prompts' chunks ended
    (a chunk ending inside a block would leave a later state in a block cached as its
    boundary's)."""
    path, expected = checkpoint
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128, block_size=4,
              max_num_batched_tokens=40, max_num_seqs=8, enable_prefix_caching=prefix_caching)
    assert llm.engine.config.block_size == 32  # a page holds a Gated DeltaNet state
    check(llm, expected, PROMPTS[:4])
    hits = llm.engine.scheduler.stats.prefix_hit_tokens
    check(llm, expected, PROMPTS[4:])
    assert llm.engine.scheduler.stats.prefix_hit_tokens - hits == (
        32 + 64 if prefix_caching else 0)
    assert llm.engine.kv_usage().used == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_transformers(checkpoint):
    """On a GPU: fp32, the Triton attention backend, prefix caching; the states and their
    recurrence are the same torch code as on the CPU."""
    path, expected = checkpoint
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton",
              kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_batched_tokens=40,
              max_num_seqs=8)
    check(llm, expected, PROMPTS[:4])
    hits = llm.engine.scheduler.stats.prefix_hit_tokens
    check(llm, expected, PROMPTS[4:])
    assert llm.engine.scheduler.stats.prefix_hit_tokens - hits == 32 + 64


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_preemption_keeps_tokens_exact(qwen3_next, prefix_caching):
    """A pool too small for four requests at once (10 blocks of 32 tokens; 14 where each
    state group holds two blocks a request under prefix caching): the newest is
    preempted, its state blocks freed, and it is computed again later."""
    path, expected = qwen3_next
    llm = LLM(str(path), kv_cache_memory_bytes=(224 if prefix_caching else 160) << 10,
              max_model_len=128, block_size=32, max_num_batched_tokens=64, max_num_seqs=4,
              enable_prefix_caching=prefix_caching)
    check(llm, expected)
    assert llm.engine.num_preemptions > 0


def test_tensor_and_pipeline_parallel_engine_matches_transformers(checkpoint):
    """tp 2 x pp 2 (gloo): each rank holds half the key-head groups of its stage's Gated
    DeltaNet layers (their conv channels and recurrent heads) and of its attention."""
    path, expected = checkpoint
    llm = LLM(str(path), kv_cache_memory_bytes="4MiB", max_model_len=128, block_size=4,
              max_num_batched_tokens=40, max_num_seqs=8, tensor_parallel_size=2,
              pipeline_parallel_size=2)
    try:
        check(llm, expected)
        assert [a.layers for a in llm.engine.parallel.state.allocations] == [
            [0, 1], [0, 1], [2, 3], [2, 3]]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("pp", [1, 2])
def test_each_rank_allocates_what_the_plan_says(qwen3_next, pp):
    """The plan (kvmem's rules) is the engine's allocation: a 32-token block of one slot
    tensor (the attention layer's and every state group's page), so 4 MiB holds 256
    blocks, no state reserved apart; at pp 2 the first stage holds only linear layers
    (one slot tensor of state pages) and allocates what its plan names."""
    from kvmem.plan import EngineSettings, Layout, plan

    path, _ = qwen3_next
    budget = 4 << 20
    llm = LLM(str(path), kv_cache_memory_bytes=budget, max_model_len=128, block_size=4,
              max_num_batched_tokens=40, max_num_seqs=8, pipeline_parallel_size=pp)
    try:
        spec = llm.engine.spec
        page = 32 * 2 * 2 * 32 * 4  # tokens x K,V x heads x head_dim x fp32
        settings = EngineSettings(kv_cache_memory_bytes=budget, block_size=4,
                                  max_model_len=128, max_num_seqs=8,
                                  max_num_batched_tokens=40, vllm_version=None)
        planned = plan(spec, Layout(pipeline_parallel_size=pp), settings, suggest=False)
        assert planned.engine.block_size == llm.engine.config.block_size == 32
        assert planned.engine.num_kv_groups == 4  # full attention, three state groups
        allocations = llm.engine.rank_state.allocations
        assert llm.engine.num_blocks == planned.engine.num_blocks == budget // page
        assert [a.layers for a in allocations] == [r.layers for r in planned.ranks]
        for a, r in zip(allocations, planned.ranks, strict=True):
            assert r.bytes_per_block == page
            assert a.num_blocks == r.num_blocks
            assert a.allocated_bytes == r.num_blocks * r.bytes_per_block <= budget
    finally:
        llm.engine.shutdown()


def run_in_turn(path, prompts, *, offload=None, faults=None, **options):
    """Each prompt after the one before has finished, in an engine of 11 blocks (and the
    null block) with 32-token chunks (each ending on a block boundary, where a state is
    checkpointed): (requests, outputs, tier stats or None, pool usage at the end)."""
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.tiers.faults import NO_FAULTS

    options = {"kv_cache_memory_bytes": 12 * PAGE, **options}
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=128,
                                    max_num_batched_tokens=32, **options), offload=offload,
                       offload_faults=faults or NO_FAULTS)
    requests, outputs = [], []
    try:
        for i, prompt in enumerate(prompts):
            requests.append(engine.add_request(f"r{i}", prompt, GREEDY))
            while engine.has_unfinished_requests():
                outputs += [out for out in engine.step() if out.finished]
            if engine.offload is not None and faults is None:
                engine.offload.offload.drain()  # the counts below do not depend on timing
        stats = engine.offload.stats()["cpu"] if engine.offload is not None else None
        return requests, outputs, stats, engine.kv_usage()
    finally:
        engine.shutdown()


PAGE = 16 << 10  # one block of the 4-layer model: 32 tokens of the attention layer's KV
A, B = LONG, PROMPTS[2]  # B's 8 blocks evict A's cached ones from the 11


@pytest.mark.parametrize("parallel", [{}, {"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}], ids=["tp1", "tp2", "pp2"])
def test_a_prompt_and_its_states_come_back_from_the_cpu_tier(qwen3_next, parallel):
    """A, B, then A again with a CPU tier: A's attention blocks and the state each state
    group checkpointed at its third block boundary are stored, B evicts them from the
    pool, and A's second run loads them (tokens equal transformers'; without the tier the
    pool alone has lost A), also at tp 2 and pp 2. The tier keys a state block by its group
    and its boundary's hash, as the pool does, so a state comes back only with the prefix
    it belongs to."""
    from kvmem.tiers import OffloadConfig

    path, expected = qwen3_next
    prompts = [A, B, A]
    # at tp 2 a rank holds half of each block: the same 12 blocks in half the bytes (at pp 2
    # the one attention layer is on one stage, whose blocks are whole)
    budget = {"kv_cache_memory_bytes": 6 * PAGE} if parallel.get("tensor_parallel_size") else {}
    requests, outputs, _, _ = run_in_turn(path, prompts, **parallel, **budget)
    assert requests[2].num_cached_tokens == 0
    requests, outputs, cpu, usage = run_in_turn(path, prompts, **parallel, **budget,
                                                offload=OffloadConfig(cpu_bytes=16 << 20))
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]
    assert requests[2].num_cached_tokens == 96  # three blocks: the last boundary before A's end
    assert cpu.hits >= 3 and cpu.failed_loads == 0  # the three states at least, from the tier
    assert usage.used == 0 and usage.held == 0


def test_a_second_long_prompt_while_the_first_ones_stores_are_in_flight(qwen3_next):
    """MISSION problem 3 on a linear-attention hybrid: A's blocks (its states' among them)
    are held by stores that take half a second each while B, another prompt, needs the
    pool's blocks: B waits for them or evicts others, nothing crashes, every request's
    tokens equal transformers', and no block stays held."""
    from kvmem.tiers import Faults, OffloadConfig

    path, expected = qwen3_next
    prompts = [A, B, A, B]
    _, outputs, cpu, usage = run_in_turn(path, prompts, offload=OffloadConfig(cpu_bytes=16 << 20),
                                         faults=Faults(store_delay_s=0.5))
    assert [o.error for o in outputs] == [None] * 4
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]
    assert cpu.stored_blocks > 0 and cpu.failed_loads == 0
    assert usage.used == 0 and usage.held == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_elastic_kv_memory_maps_and_gives_back_state_pages(qwen3_next, tp, tmp_path,
                                                           monkeypatch):
    """--kv-memory elastic: the state groups' blocks are in the same pages as the attention
    blocks, mapped when they are taken. Tokens equal transformers' with prefix caching (the
    state checkpoints hit from mapped pages), at tp 1 and 2; once every cached page is given
    back, the same prompts find no checkpoint and give the same tokens again."""
    monkeypatch.setenv("KVMEM_LEDGER_DIR", str(tmp_path))
    path, expected = qwen3_next
    llm = LLM(str(path), kv_memory="elastic", tensor_parallel_size=tp,
              kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_batched_tokens=40,
              max_num_seqs=8)
    try:
        engine = llm.engine
        check(llm, expected, PROMPTS[:4])
        stats = engine.scheduler.stats
        hits = stats.prefix_hit_tokens
        check(llm, expected, PROMPTS[4:])
        assert stats.prefix_hit_tokens - hits == 32 + 64
        held = engine.elastic.storage.table.held_bytes
        with engine.steps.lock:
            given = engine.elastic.reclaim(held)
        assert given > 0 and engine.elastic.storage.table.held_bytes < held
        hits = stats.prefix_hit_tokens
        check(llm, expected, PROMPTS[4:])
        assert stats.prefix_hit_tokens == hits  # the checkpoints went with their pages
        assert engine.kv_usage().used == 0
    finally:
        llm.engine.shutdown()


def test_state_groups_follow_vllms_grouping_and_pages_hold_a_state():
    """8 layers, 3 : 1: the full-attention pair, then three pairs of linear layers sharing
    its two slot tensors; the block size rises to the first multiple of 16 whose page
    holds a state (2,624 values against 128 per token: 32), also per rank at tp 2."""
    spec = spec_from_config(tiny_qwen3_next(8, "float32"), "tiny")
    groups = engine_kv_groups(spec)
    assert [(g.kind, g.layers) for g in groups] == [
        (AttentionKind.FULL, (3, 7)), (AttentionKind.LINEAR, (0, 1)),
        (AttentionKind.LINEAR, (2, 4)), (AttentionKind.LINEAR, (5, 6))]
    assert engine_layer_slots(spec) == {3: 0, 7: 1, 0: 0, 1: 1, 2: 0, 4: 1, 5: 0, 6: 1}
    assert state_block_size(spec, 4, 1) == state_block_size(spec, 4, 2) == 32
    assert state_block_size(spec, 48, 1) == 48
    wider = spec_from_config({**tiny_qwen3_next(8, "float32"), "linear_value_head_dim": 64},
                             "wider")  # 5,056 values: 40 tokens, 48 in multiples of 16
    assert state_block_size(wider, 16, 1) == 48


def test_more_attention_than_linear_layers_is_refused():
    config = {**tiny_qwen3_next(4, "float32"),
              "layer_types": ["linear_attention"] + ["full_attention"] * 3}
    with pytest.raises(ConfigError, match="fewer linear-attention layers"):
        engine_kv_groups(spec_from_config(config, "tiny"))


def test_a_step_budget_below_the_block_size_is_refused_under_prefix_caching(qwen3_next):
    """Chunks must end on a block boundary: a 16-token budget never reaches one."""
    path, _ = qwen3_next
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(16\) must be at least"):
        LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_seqs=8,
            max_num_batched_tokens=16)


def test_a_disk_tier_written_with_one_state_layout_is_not_read_with_another():
    """The tiers' layout names each state group's state: a hybrid whose states differ
    (another conv kernel here) stores under another layout, and so never reads blocks
    the first one wrote; the attention group is named as it always was."""
    from kvmem.engine.offload_setup import tier_identity

    def layout(**overrides) -> str:
        spec = spec_from_config({**tiny_qwen3_next(4, "float32"), **overrides}, "tiny")
        return tier_identity(spec, torch.float32, None, tensor_parallel_size=1,
                             partition=[4], dummy_seed=0)[1]

    first, other = layout(), layout(linear_conv_kernel_dim=3)
    assert first != other
    assert "groups=full_attention:None:3;linear_attention:None:0:" in first
    assert first.count("linear_attention") == other.count("linear_attention") == 3
