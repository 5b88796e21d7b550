"""Logprobs: output and prompt logprobs equal transformers' fp32 log-softmax of the same
weights, with chunked prefill, a prefix-cache hit bypassed, preemption and sampling."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from kvmem.engine.llm import LLM
from kvmem.engine.sampling_params import SamplingParams

TOL = 1e-4
PROMPT = [(i * 11) % 250 for i in range(45)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("logprobs"), "llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[len - 1, vocab]``: row p is the distribution over token p + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_position(entry, expected_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - expected_row[token].item()) < TOL
    assert entry.rank == int((expected_row > expected_row[token]).sum()) + 1
    values, ids = expected_row.topk(k)
    assert len(entry.top) == k
    for (tid, lp), eid, ev in zip(entry.top, ids.tolist(), values.tolist(), strict=True):
        assert abs(lp - ev) < TOL
        assert tid == eid or abs(expected_row[tid].item() - ev) < TOL  # ties may swap


@pytest.mark.parametrize("chunk", [256, 16])
def test_prompt_and_output_logprobs_match_transformers(model_dir, hf_model, chunk):
    llm = LLM(str(model_dir), kv_cache_memory_bytes=4 << 20, max_model_len=128,
              max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True,
                            logprobs=3, prompt_logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    full = PROMPT + out.token_ids
    expected = hf_logprobs(hf_model, full)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        check_position(entry, expected[p], PROMPT[p + 1], 2)
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(out.token_ids)
    for i, entry in enumerate(logprobs):
        check_position(entry, expected[len(PROMPT) - 1 + i], out.token_ids[i], 3)


def test_prompt_logprobs_bypass_prefix_cache_hit(model_dir, hf_model):
    llm = LLM(str(model_dir), kv_cache_memory_bytes=4 << 20, max_model_len=128)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([PROMPT], greedy)  # fills the prefix cache
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    expected = hf_logprobs(hf_model, PROMPT)
    assert len(out.prompt_logprobs) == len(PROMPT)
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        check_position(entry, expected[p], PROMPT[p + 1], 0)
    assert llm.generate([PROMPT], greedy)[0].num_cached_tokens > 0  # others still hit


def test_logprobs_survive_preemption(model_dir, hf_model):
    from test_engine import kv_bytes_for_tokens

    # room for ~3 requests of 64 tokens: four of them preempt each other
    llm = LLM(str(model_dir), kv_cache_memory_bytes=kv_bytes_for_tokens(model_dir, 192),
              max_model_len=128, enable_prefix_caching=False)
    prompts = [[(i * 13 + j) % 250 for i in range(40)] for j in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_logprobs(hf_model, prompt + out.token_ids)
        assert len(out.prompt_logprobs) == len(prompt)
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            check_position(entry, expected[p], prompt[p + 1], 1)
        assert len(out.outputs[0].logprobs) == 24
        for i, entry in enumerate(out.outputs[0].logprobs):
            check_position(entry, expected[len(prompt) - 1 + i], out.token_ids[i], 1)
