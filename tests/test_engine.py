"""Engine end to end: greedy fp32 tokens equal transformers ``generate`` on the same weights,
with prefix caching on and off, chunked prefill, preemption and mixed-length batches."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from kvmem.engine.errors import InvalidRequestError, PromptTooLongError
from kvmem.engine.llm import LLM
from kvmem.engine.sampling_params import SamplingParams
from kvmem.spec import spec_from_config

NEW_TOKENS = 12
# mixed lengths; the last two share a 32-token prefix so prefix caching has something to hit
PROMPTS = [
    [7, 3, 9],
    list(range(20, 57)),
    [(i * 7) % 250 for i in range(70)],
    list(range(100, 132)) + [5, 6, 7, 8, 9],
    list(range(100, 132)) + [11, 12],
]


def hf_greedy(model_dir, prompts, n=NEW_TOKENS):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])  # an explicit mask: token 0 is not padding here
            ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 generation_config=config)[0, len(p):].tolist()
            assert len(ids) == n
            outs.append(ids)
    return outs


def hf_greedy_forward(model_dir, prompts, n=NEW_TOKENS):
    """Greedy tokens from transformers' forward with its KV cache, never stopping at EOS
    (``generate`` falls back to the checkpoint's EOS when given none)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            tokens = []
            for _ in range(n):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                            use_cache=True)
            outs.append(tokens)
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return path, hf_greedy(path, PROMPTS)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def kv_bytes_for_tokens(model_dir, tokens: int) -> int:
    import json

    spec = spec_from_config(json.loads((model_dir / "config.json").read_text()))
    return tokens * spec.kv_bytes_per_token(dtype_bytes=4)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(tiny, prefix_caching):
    path, expected = tiny
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128,
              enable_prefix_caching=prefix_caching)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    hits = llm.engine.scheduler.stats.prefix_hit_tokens
    assert (hits > 0) == prefix_caching  # the shared 32-token prefix was reused (or not)


def test_chunked_prefill_small_chunks(tiny):
    path, expected = tiny
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128,
              max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats.steps > sum(map(len, PROMPTS)) // 8  # every step held <= 8 tokens


def test_preemption_keeps_outputs_exact(tiny):
    path, _ = tiny
    prompts = [list(range(start, start + 30)) for start in (10, 60, 110)]
    # ~100 tokens of room: the three 30-token prompts are admitted together, but they cannot
    # all grow to 42 tokens, so the newest is preempted and recomputed later. (qwen2's
    # sliding-window layer drops blocks that leave its window, so it needs a smaller pool.)
    room = 80 if path.name.endswith("qwen2") else 100
    llm = LLM(str(path), kv_cache_memory_bytes=kv_bytes_for_tokens(path, room),
              max_model_len=48, block_size=4)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts)
    assert llm.engine.kv_usage().used == 0  # every block came back


def test_prefix_hit_skips_computation(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128)
    shared = list(range(40, 90))
    first = llm.generate([shared + [1, 2]], GREEDY)[0]
    steps_before = llm.engine.stats.steps
    second = llm.generate([shared + [3, 4]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # three full 16-token blocks of the 50 shared
    assert llm.engine.stats.steps - steps_before == NEW_TOKENS
    cold = LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128,
               enable_prefix_caching=False)
    assert cold.generate([shared + [3, 4]], GREEDY)[0].token_ids == second.token_ids


def test_many_requests_of_spread_lengths_match_transformers(tiny):
    """24 requests decode together; their rows are split into several padded batches by
    context length (and prompts arrive over several steps, so decodes sit beside chunks)."""
    path, _ = tiny
    prompts = [[(i * 31 + j * 7) % 250 + 1 for j in range(3 + 4 * i)] for i in range(24)]
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=128,
              max_num_batched_tokens=256)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy_forward(path, prompts)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama_small"), "llama")
    return path, LLM(str(path), kv_cache_memory_bytes=4 << 20, max_model_len=64)


def test_too_long_prompt_rejected_before_admission(tiny_llama):
    _, llm = tiny_llama
    with pytest.raises(PromptTooLongError, match="max_model_len is 64"):
        llm.generate([list(range(64))], GREEDY)
    with pytest.raises(PromptTooLongError, match="exceeds max_model_len 64"):
        llm.generate([list(range(60))], SamplingParams(max_tokens=10))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == NEW_TOKENS


def test_max_tokens_none_stops_at_max_model_len(tiny_llama):
    _, llm = tiny_llama
    out = llm.generate([list(range(50))], SamplingParams(max_tokens=None, temperature=0,
                                                         ignore_eos=True))[0]
    assert len(out.token_ids) == 14 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_eos(tiny_llama, tmp_path):
    path, llm = tiny_llama
    tokens = llm.generate([[7, 3, 9]], GREEDY)[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[tokens[stop_at]])
    out = llm.generate([[7, 3, 9]], params)[0]
    assert out.token_ids == tokens[:stop_at + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == tokens[stop_at]
    # the same weights with that token as end-of-sequence: stops there unless ignore_eos
    eos_path = make_tiny_checkpoint(tmp_path, "llama", eos_token_id=tokens[stop_at])
    eos_llm = LLM(str(eos_path), kv_cache_memory_bytes=4 << 20, max_model_len=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    assert eos_llm.generate([[7, 3, 9]], params)[0].token_ids == tokens[:stop_at + 1]
    assert eos_llm.generate([[7, 3, 9]], GREEDY)[0].token_ids == tokens


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(tiny_llama):
    """vLLM's min_tokens: a logit bias makes EOS (258), then a stop token id, the greedy
    choice at every position; until min_tokens are generated neither is picked nor ends
    the request, and no stop string ends it either (it used to be ignored: 200 and
    nothing done)."""
    _, llm = tiny_llama
    eos = SamplingParams(max_tokens=10, temperature=0, logit_bias={258: 100})
    assert llm.generate([[7, 3, 9]], eos)[0].token_ids == [258]
    held = llm.generate([[7, 3, 9]], SamplingParams(max_tokens=10, temperature=0,
                                                    logit_bias={258: 100}, min_tokens=4))[0]
    assert len(held.token_ids) == 5 and 258 not in held.token_ids[:4]
    assert held.token_ids[4] == 258 and held.outputs[0].finish_reason == "stop"
    stop = SamplingParams(max_tokens=10, temperature=0, logit_bias={42: 100},
                          stop_token_ids=[42], min_tokens=3)
    out = llm.generate([[7, 3, 9]], stop)[0]
    assert len(out.token_ids) == 4 and out.token_ids[3] == 42 and 42 not in out.token_ids[:3]
    plain = llm.generate([[7, 3, 9]], SamplingParams(max_tokens=6, temperature=0,
                                                     ignore_eos=True))[0]
    first = plain.outputs[0].text[:1]  # a stop string the first tokens' text completes
    early = llm.generate([[7, 3, 9]], SamplingParams(max_tokens=6, temperature=0,
                                                     ignore_eos=True, stop=[first]))[0]
    assert len(early.token_ids) < 6 and early.outputs[0].finish_reason == "stop"
    late = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=[first],
                          min_tokens=6)
    assert llm.generate([[7, 3, 9]], late)[0].token_ids == plain.token_ids
    with pytest.raises(InvalidRequestError, match="min_tokens must be at most max_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_abort_frees_blocks(tiny_llama):
    _, llm = tiny_llama
    engine = llm.engine
    engine.add_request("a", list(range(30)), GREEDY)
    engine.add_request("b", list(range(5)), GREEDY)
    engine.step()
    assert engine.kv_usage().used > 0
    outs = engine.abort_request(["a", "b"])
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert engine.kv_usage().used == 0 and not engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    _, llm = tiny_llama
    seeded = SamplingParams(max_tokens=10, temperature=1.5, seed=1234, ignore_eos=True)
    alone = llm.generate([[4, 5, 6]], seeded)[0].token_ids
    batched = llm.generate([[9, 9, 9], [4, 5, 6], list(range(30))],
                           [GREEDY, seeded, SamplingParams(max_tokens=5, temperature=1.0)])
    assert batched[1].token_ids == alone
    other = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=10, temperature=1.5, seed=99,
                                                     ignore_eos=True))[0].token_ids
    assert other != alone
    top1 = SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert llm.generate([[4, 5, 6]], top1)[0].token_ids == \
        llm.generate([[4, 5, 6]], greedy)[0].token_ids
