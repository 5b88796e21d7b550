"""The embedded SmolLM2-135M-Instruct: greedy tokens equal transformers (as configured by
default, without prefix caching, with small prefill chunks, under preemption and in a
batch of mixed lengths), text-level stops, streaming deltas and the chat template, through
the offline ``LLM`` API."""

from __future__ import annotations

import pytest
import torch

from kvmem.engine.llm import LLM
from kvmem.engine.loader import resolve_model
from kvmem.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
N = 16
# three lengths (a few tokens to a dozen) for the batch variants; PROMPT is the first
PROMPTS = [PROMPT, "Hi", "Once upon a time, in a small village by the sea, there lived"]
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
BLOCK = 8


@pytest.fixture(scope="module")
def llm():
    return LLM(None, kv_cache_memory_bytes=64 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def hf_batch(llm) -> list[list[int]]:
    """transformers' greedy tokens for each of PROMPTS, one prompt at a time (no padding)."""
    import transformers

    path = resolve_model(None).path
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = transformers.GenerationConfig(max_new_tokens=N, do_sample=False, eos_token_id=None,
                                           pad_token_id=None)
    tokens = []
    for prompt in PROMPTS:
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 generation_config=config)
        tokens.append(out[0, ids.shape[1]:].tolist())
    return tokens


@pytest.fixture(scope="module")
def hf_tokens(hf_batch):
    return hf_batch[0]


def test_greedy_matches_transformers(llm, hf_tokens):
    out = llm.generate(PROMPT, GREEDY)[0]
    assert out.token_ids == hf_tokens
    assert out.text == llm.tokenizer.decode(hf_tokens)


def test_mixed_length_batch_matches_transformers(llm, hf_batch):
    outs = llm.generate(PROMPTS, GREEDY)
    assert len({len(o.prompt_token_ids) for o in outs}) == 3
    assert [o.token_ids for o in outs] == hf_batch


def kv_bytes_for_blocks(blocks: int) -> int:
    from kvmem.spec import spec_from_config

    files = resolve_model(None)
    spec = spec_from_config(files.config, files.name)
    return blocks * BLOCK * spec.kv_bytes_per_token(dtype_bytes=4)


# Each runs the mixed-length batch through an engine configured otherwise than the default.
VARIANTS = {
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "prefill_chunks_of_4": dict(max_num_batched_tokens=4),
    # 6 blocks of 8 tokens (+ the null block): the three requests grow to 3, 3 and 4
    # blocks, so one at least is preempted and recomputed; max_model_len 48 fits one alone
    "preemption": dict(kv_blocks=7, max_model_len=48, block_size=BLOCK),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_variants_match_transformers(variant, hf_batch):
    options = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512, **VARIANTS[variant]}
    if "kv_blocks" in options:
        options["kv_cache_memory_bytes"] = kv_bytes_for_blocks(options.pop("kv_blocks"))
    llm = LLM(None, **options)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_batch
    engine = llm.engine
    if variant == "no_prefix_caching":  # finished requests' full blocks were not kept
        assert engine.scheduler.stats.prefix_hit_tokens == 0 and engine.kv_usage().cached == 0
    if variant == "prefill_chunks_of_4":  # every step held at most 4 tokens
        assert engine.stats.steps >= sum(len(o.prompt_token_ids) for o in outs) // 4 + N
    if variant == "preemption":
        assert engine.num_preemptions > 0 and engine.kv_usage().used == 0


def test_stop_string_cuts_text(llm, hf_tokens):
    full = llm.tokenizer.decode(hf_tokens)
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    cut = full.index(stop)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPT, params)[0]
    assert out.text == full[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < N
    keep = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=[stop],
                          include_stop_str_in_output=True)
    assert llm.generate(PROMPT, keep)[0].text == full[:cut + len(stop)]


def test_streamed_deltas_add_up_and_hide_partial_stops(llm, hf_tokens):
    full = llm.tokenizer.decode(hf_tokens)
    stop = full.split()[3]
    engine = llm.engine
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=N, temperature=0, stop=[stop],
                                                   ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            assert stop not in "".join(deltas)  # never streamed, not even in part at the end
            final = out
    assert "".join(deltas) == final.text == full[:full.index(stop)]


def test_chat_template_prompt(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(max_tokens=8, temperature=0))
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert 1 <= len(out.token_ids) <= 8 and out.text
