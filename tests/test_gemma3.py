"""Gemma 3's text decoder against transformers' on the same random weights (fp32).

Four checkpoints: a ``Gemma3ForCausalLM`` (attention scale, RoPE bases and scaling, layer
pattern and logit soft-capping all away from their defaults) and three shaped like
``Gemma3ForConditionalGeneration`` (nested ``text_config``, a vision tower the engine does
not load): weights under ``language_model.model.`` or ``model.language_model.``, and one
whose text_config names only what gemma-3-4b-it's does. Every prompt but one is longer
than the 16-token sliding window, so the window and both kinds of KV group count.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_models import PagedRun, load
from tiny_models import make_tiny_gemma3, make_tiny_gemma3_multimodal

from kvmem.cli import main
from kvmem.engine.llm import LLM
from kvmem.engine.models import build_model
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import ConfigError
from kvmem.spec import AttentionKind, spec_from_config

WINDOW = 16
LINEAR_ROPE = {"rope_type": "linear", "factor": 8.0}
CHECKPOINTS = {
    "causal": lambda d: make_tiny_gemma3(
        d, sliding_window=WINDOW, initializer_range=0.1, query_pre_attn_scalar=24,
        rope_theta=100_000.0, rope_local_base_freq=1_000.0, rope_scaling=LINEAR_ROPE,
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention"]),
    "multimodal": lambda d: make_tiny_gemma3_multimodal(
        d, names="transformers5", sliding_window=WINDOW, initializer_range=0.1),
    "multimodal-4.52": lambda d: make_tiny_gemma3_multimodal(
        d, names="transformers4.52", sliding_window=WINDOW, initializer_range=0.1),
    "gemma-3-4b-it": lambda d: make_tiny_gemma3_multimodal(
        d, names="gemma-3-4b-it", sliding_window=WINDOW, initializer_range=0.1,
        rope_scaling=LINEAR_ROPE),
}
NEW_TOKENS = 10
SHARED = [(i * 13) % 250 for i in range(40)]  # a prefix longer than the window
PROMPTS = [SHARED + [1, 2, 3], [7, 3, 9], [(i * 7) % 250 for i in range(53)], SHARED + [4, 5]]
TOL = 5e-5  # fp32; the two implementations differ by a few 1e-6


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def gemma(request, tmp_path_factory):
    """(checkpoint directory, transformers' model of it)."""
    import transformers

    path = CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))
    model_cls = transformers.Gemma3ForCausalLM if request.param == "causal" \
        else transformers.Gemma3ForConditionalGeneration
    return path, model_cls.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def _cache_of(out) -> dict:
    """The KV cache a transformers output carries, as the next call takes it (``cache``
    in recent transformers, ``past_key_values`` before)."""
    if hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens, decoding with its own (sliding-window) KV cache."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), use_cache=True, **_cache_of(out))
    return tokens


def test_paged_model_logits_match_transformers(gemma):
    """Chunked prefill (5 tokens a step) and batched decode over shuffled 4-token blocks:
    the logits at every position."""
    path, reference = gemma
    files, model = load(path)
    spec = spec_from_config(files.config)
    assert {g.kind for g in spec.kv_groups()} == {AttentionKind.FULL, AttentionKind.SLIDING}
    outputs, logits = PagedRun(model, files.config).generate(PROMPTS[1:3], NEW_TOKENS)
    for prompt, out, got in zip(PROMPTS[1:3], outputs, logits, strict=True):
        expected = hf_logits(reference, prompt + out[:-1])
        torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


def check_engine(llm: LLM, reference, tol: float = TOL) -> None:
    """Greedy tokens as transformers decodes them, every prompt and output logprob (the
    log-softmax of the logits, the top 5 alternatives too), then a prefix-cache hit of the
    shared prefix's whole blocks across both kinds of KV group."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=5, prompt_logprobs=5)
    outs = llm.generate(PROMPTS[:3], params)
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        assert out.token_ids == hf_greedy(reference, prompt)
        expected = torch.log_softmax(hf_logits(reference, prompt + out.token_ids), dim=-1)
        entries = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
        targets = [*prompt[1:], *out.token_ids]
        for row, entry, token in zip(expected[:-1], entries, targets, strict=True):
            assert entry.token_id == token and abs(entry.logprob - row[token].item()) < tol
            values, ids = row.topk(5)
            assert [t for t, _ in entry.top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top]), values,
                                       atol=tol, rtol=0)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    hits = llm.engine.scheduler.stats.prefix_hit_tokens
    assert llm.generate([PROMPTS[3]], greedy)[0].token_ids == hf_greedy(reference, PROMPTS[3])
    block = llm.engine.config.block_size
    assert llm.engine.scheduler.stats.prefix_hit_tokens - hits == len(SHARED) // block * block
    assert llm.engine.kv_usage().used == 0


def test_engine_greedy_tokens_and_logprobs_match_transformers(gemma):
    """Through the engine, with chunked prefill (24-token steps) and 4-token blocks."""
    path, reference = gemma
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, max_model_len=128, block_size=4,
              max_num_batched_tokens=24)
    check_engine(llm, reference)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_cuda_triton_engine_matches_transformers(tmp_path_factory, eager):
    """On a GPU: the Triton attention backend, fp32, decode steps in CUDA graphs or not."""
    import transformers

    path = CHECKPOINTS["gemma-3-4b-it"](tmp_path_factory.mktemp("cuda"))
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton",
              kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_batched_tokens=24,
              enforce_eager=eager)
    assert (llm.engine.model_runner.cuda_graphs is None) == eager
    check_engine(llm, reference, tol=2e-4)


def test_tensor_and_pipeline_parallel_engine_matches_transformers(tmp_path_factory):
    """tp 2 x pp 2 (gloo): each rank holds a stage's three layers (a full one and two
    sliding ones) and half the heads; the first stage scales the embeddings, the last
    soft-caps the logits."""
    import transformers

    path = CHECKPOINTS["causal"](tmp_path_factory.mktemp("parallel"))
    reference = transformers.Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(str(path), kv_cache_memory_bytes="4MiB", max_model_len=128, block_size=4,
              max_num_batched_tokens=24, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy)
        assert [o.token_ids for o in outs] == [hf_greedy(reference.eval(), p) for p in PROMPTS]
        assert [a.layers for a in llm.engine.parallel.state.allocations] == [
            [0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    finally:
        llm.engine.shutdown()


def test_the_vision_tower_is_not_loaded(tmp_path_factory, capsys):
    """A multimodal checkpoint: the engine loads its language model only, which is what
    ``kvmem profile`` measures and ``kvmem plan --engine kvmem`` counts from the
    safetensors headers; vLLM's plan counts the vision tower and projector too."""
    from safetensors import safe_open

    path = CHECKPOINTS["gemma-3-4b-it"](tmp_path_factory.mktemp("profile"))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        sizes = {name: f.get_tensor(name).nbytes for name in f.keys()}  # noqa: SIM118
    text = sum(n for name, n in sizes.items() if name.startswith("language_model."))
    assert sum(sizes.values()) > text
    assert main(["profile", str(path), "--device", "cpu", "--max-num-batched-tokens", "64",
                 "--max-num-seqs", "4", "--json"]) == 0
    # the tied LM head is a second copy of the embedding in the engine (laid out for the GEMM)
    lm_head = sizes["language_model.model.embed_tokens.weight"]
    assert json.loads(capsys.readouterr().out)["weights_bytes"] == text + lm_head

    def planned_weights(engine: str) -> int:
        assert main(["plan", str(path), "--engine", engine, "--device", "cpu",
                     "--kv-cache-memory-bytes", "1MiB", "--max-model-len", "64", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["ranks"][0]["weights_bytes"]

    assert planned_weights("kvmem") == text
    assert planned_weights("vllm") == sum(sizes.values())


@pytest.mark.parametrize("field, value, says", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "activation 'relu' is not supported"),
])
def test_what_the_decoder_does_not_do_is_a_config_error(field, value, says):
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "vocab_size": 32, "sliding_window": 4, field: value}
    with pytest.raises(ConfigError, match=says):
        build_model(config, attention_backend="reference")
