"""The embedded SmolLM2-135M-Instruct: greedy tokens equal transformers, text-level stops,
streaming deltas and the chat template, through the offline ``LLM`` API."""

from __future__ import annotations

import pytest
import torch

from kvmem.engine.llm import LLM
from kvmem.engine.loader import resolve_model
from kvmem.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
N = 16


@pytest.fixture(scope="module")
def llm():
    return LLM(None, kv_cache_memory_bytes=64 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def hf_tokens(llm):
    import transformers

    path = resolve_model(None).path
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([llm.tokenizer.encode(PROMPT)])
    config = transformers.GenerationConfig(max_new_tokens=N, do_sample=False, eos_token_id=None,
                                           pad_token_id=None)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_matches_transformers(llm, hf_tokens):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_tokens
    assert out.text == llm.tokenizer.decode(hf_tokens)


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
