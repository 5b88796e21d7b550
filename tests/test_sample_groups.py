"""n > 1 and best_of: the samples share the prompt's KV blocks (forked after the prompt's
prefill), each sample equals a single request with its seed, and preemption, abort and
the prefix cache stay correct with siblings."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_checkpoint

from kvmem.engine.config import EngineConfig
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams

PROMPT = [(i * 7) % 250 for i in range(150)]  # 9 full blocks of 16 and 6 tokens
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("groups"), "llama")


def engine_for(model_dir, **kw) -> LLMEngine:
    options = dict(model=str(model_dir), max_model_len=256, block_size=BLOCK,
                   kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False)
    return LLMEngine(EngineConfig(**{**options, **kw}))


def run(engine: LLMEngine, params: SamplingParams, prompt=PROMPT, rid="r"):
    engine.add_request(rid, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n8_allocates_the_prompt_blocks_once(model_dir, prefix_caching):
    engine = engine_for(model_dir, enable_prefix_caching=prefix_caching)
    params = SamplingParams(n=8, max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("g", PROMPT, params)
    engine.step()  # the prompt's prefill; sample 0 samples and the group forks
    mgr = engine.kv_cache_manager
    parent = mgr.get_block_ids("g")[0]
    shared = (len(PROMPT) - 1) // BLOCK
    children = [mgr.get_block_ids(f"g#{i}")[0] for i in range(1, 8)]
    for table in children:
        assert table[:shared] == parent[:shared]  # references, not copies
    assert all(mgr.pool.ref_cnt[b] == 8 for b in parent[:shared])
    engine.step()  # the children recompute the last, partial block and sample
    used = mgr.usage().used
    # the shared 9 blocks once, plus each sample's own partial block (10th)
    assert used == shared + 8 * (len(parent) - shared), (used, len(parent))
    single = shared + len(parent) - shared
    assert used < 8 * single / 4
    while engine.has_unfinished_requests():
        outs = engine.step()
    [final] = [o for o in outs if o.finished]
    assert [c.index for c in final.outputs] == list(range(8))
    assert mgr.usage().used == 0
    assert engine.snapshot().prompt_tokens == len(PROMPT)  # one prompt, not eight


def test_each_sample_is_reproducible_and_distinct(model_dir):
    engine = engine_for(model_dir)
    group = run(engine, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=5,
                                       ignore_eos=True))
    samples = [c.token_ids for c in group.outputs]
    assert len({tuple(s) for s in samples}) == 4
    for i, tokens in enumerate(samples):
        alone = run(engine, SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i,
                                           ignore_eos=True), rid=f"single{i}")
        assert alone.token_ids == tokens
    again = run(engine, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=5,
                                       ignore_eos=True), rid="again")
    assert [c.token_ids for c in again.outputs] == samples


def test_siblings_survive_preemption_and_match_unpreempted_runs(model_dir):
    from test_engine import kv_bytes_for_tokens

    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=2, ignore_eos=True)
    roomy = run(engine_for(model_dir), params)
    tight = engine_for(model_dir, kv_cache_memory_bytes=kv_bytes_for_tokens(model_dir, 300))
    squeezed = run(tight, params)
    assert tight.num_preemptions > 0
    assert [c.token_ids for c in squeezed.outputs] == [c.token_ids for c in roomy.outputs]
    assert tight.kv_cache_manager.usage().used == 0


def test_abort_frees_every_sample(model_dir):
    engine = engine_for(model_dir)
    engine.add_request("g", PROMPT, SamplingParams(n=5, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.usage().used > 0
    [out] = engine.abort_request("g")
    assert out.finished and len(out.outputs) == 5
    assert all(c.finish_reason == "abort" for c in out.outputs)
    assert engine.kv_cache_manager.usage().used == 0
    assert not engine.has_unfinished_requests() and not engine.groups


def test_best_of_keeps_the_most_likely_samples(model_dir):
    engine = engine_for(model_dir)
    out = run(engine, SamplingParams(n=2, best_of=5, max_tokens=5, temperature=1.0, seed=3,
                                     ignore_eos=True))
    assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
    everything = run(engine, SamplingParams(n=5, max_tokens=5, temperature=1.0, seed=3,
                                            logprobs=0, ignore_eos=True), rid="all")
    best = sorted(everything.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]


def test_greedy_samples_agree_and_short_groups_finish(model_dir):
    engine = engine_for(model_dir, enable_prefix_caching=True)
    out = run(engine, SamplingParams(n=3, max_tokens=1, temperature=0))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    short = run(engine, SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True),
                prompt=[5, 6, 7], rid="short")  # no full block to share: children recompute
    assert len({tuple(c.token_ids) for c in short.outputs}) == 1
    assert engine.kv_cache_manager.usage().used == 0
