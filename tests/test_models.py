"""The paged-cache model against transformers on the same weights (fp32).

Prompts are prefilled in chunks, several sequences share each step (mixed prefill and
decode batches, then decode-only batches), blocks are handed out in shuffled order and
KV groups share slot tensors as the engine lays them out. Every position's logits must
match transformers' forward over the whole sequence, and greedy tokens must match
transformers' ``generate``.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from kvmem.engine.attention import AttentionMetadata
from kvmem.engine.loader import resolve_model
from kvmem.engine.models import build_model
from kvmem.errors import ConfigError
from kvmem.memory.storage import SlotShape, TensorKVStorage
from kvmem.spec import spec_from_config

ATOL = 2e-4


class PagedRun:
    """Drives a model step by step over a paged cache the way an engine does."""

    def __init__(self, model, config: dict, block_size: int = 4, num_blocks: int = 256,
                 chunk: int = 5, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.model, self.block_size, self.chunk = model, block_size, chunk
        spec = spec_from_config(config)
        self.groups = spec.kv_groups()
        slots = spec.layer_slots()
        self.storage = TensorKVStorage(
            num_blocks, max(slots.values()) + 1,
            SlotShape(2, block_size, spec.num_kv_heads, spec.head_dim), dtype)
        self.kv_caches = [self.storage.slot_tensor(slots[i]) for i in range(spec.num_layers)]
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)

    def generate(self, prompts: list[list[int]], max_new_tokens: int
                 ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy outputs per prompt, and the logits the model gave at every position."""
        seqs = [list(p) for p in prompts]
        done = [0] * len(seqs)  # tokens already in the cache
        tables = [[[] for _ in seqs] for _ in self.groups]
        logits = [[] for _ in seqs]
        while batch := [i for i, s in enumerate(seqs)
                        if len(s) - len(prompts[i]) < max_new_tokens]:
            q_lens = [min(self.chunk, len(seqs[i]) - done[i]) for i in batch]
            ids, pos = [], []
            for i, q in zip(batch, q_lens, strict=True):
                ids += seqs[i][done[i]:done[i] + q]
                pos += range(done[i], done[i] + q)
                for g in range(len(self.groups)):
                    while len(tables[g][i]) * self.block_size < done[i] + q:
                        tables[g][i].append(self.free.pop())
                done[i] += q
            meta = AttentionMetadata.build(q_lens, [done[i] for i in batch],
                                           [[t[i] for i in batch] for t in tables],
                                           self.block_size)
            with torch.no_grad():
                hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.kv_caches)
                step_logits = self.model.compute_logits(hidden)
            start = 0
            for i, q in zip(batch, q_lens, strict=True):
                logits[i].append(step_logits[start:start + q].float())
                start += q
                if done[i] == len(seqs[i]):
                    seqs[i].append(int(step_logits[start - 1].argmax()))
        return ([s[len(p):] for s, p in zip(seqs, prompts, strict=True)],
                [torch.cat(rows) for rows in logits])


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy output (it stops after an end-of-sequence token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def load(path, **kw):
    files = resolve_model(str(path))
    model = build_model(files.config, dtype=torch.float32, device="cpu",
                        attention_backend="reference", **kw)
    model.load_weights(files.weights())
    return files, model


LLAMA3_ROPE = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}}


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("llama", LLAMA3_ROPE), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
], ids=["llama", "llama3-rope", "qwen2", "qwen3", "mistral"])
def test_tiny_models_match_transformers(tmp_path, family, overrides):
    path = make_tiny_checkpoint(tmp_path, family, **overrides)
    files, model = load(path)
    reference = hf_model(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (13, 3, 22)]
    n_new = 12
    outputs, logits = PagedRun(model, files.config).generate(prompts, n_new)
    for prompt, out, got in zip(prompts, outputs, logits, strict=True):
        assert until_eos(out, files.config["eos_token_id"]) == hf_greedy(reference, prompt, n_new)
        full = torch.tensor([prompt + out[:-1]])
        with torch.no_grad():
            expected = reference(full).logits[0].float()
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


def test_sliding_window_is_applied(tmp_path):
    """The qwen2 tiny model's second layer slides over 8 tokens; without it logits differ."""
    path = make_tiny_checkpoint(tmp_path, "qwen2")
    files, model = load(path)
    prompt = list(range(40, 70))
    _, windowed = PagedRun(model, files.config).generate([prompt], 1)
    model.layers[1].self_attn.sliding_window = None
    _, full = PagedRun(model, files.config).generate([prompt], 1)
    assert torch.allclose(windowed[0][:8], full[0][:8], atol=1e-6)  # inside the window
    assert not torch.allclose(windowed[0][8:], full[0][8:], atol=1e-3)


def test_checkpoint_style_rope_config_equals_the_new_style():
    """Checkpoints spell RoPE as rope_theta + rope_scaling; newer configs as rope_parameters."""
    from kvmem.engine.models.rope import inverse_frequencies, rope_parameters

    new = rope_parameters(LLAMA3_ROPE)
    old_params = {k: v for k, v in LLAMA3_ROPE["rope_parameters"].items() if k != "rope_theta"}
    old = rope_parameters({"rope_theta": 500000.0, "rope_scaling": old_params})
    assert torch.equal(inverse_frequencies(16, new, None), inverse_frequencies(16, old, None))
    default = inverse_frequencies(16, rope_parameters({"rope_theta": 500000.0}), None)
    assert not torch.equal(default, inverse_frequencies(16, new, None))


def test_unsupported_rope_scaling_is_a_config_error(tmp_path):
    config = dict(resolve_model(str(make_tiny_checkpoint(tmp_path, "llama"))).config)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ConfigError, match="'yarn' is not supported"):
        build_model(config)


def test_pipeline_stages_compose(tmp_path):
    """Two stages (layer 0 | layer 1) passing hidden states equal the whole model."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    files, whole = load(path)
    _, first = load(path, layers=range(0, 1))
    _, last = load(path, layers=range(1, 2))
    assert first.lm_head is None and last.embed_tokens is None
    ids = torch.arange(30, 39)
    pos = torch.arange(9)

    def run(model_fn):
        run_ = PagedRun(whole, files.config)
        meta = AttentionMetadata.build([9], [9], [[run_.free[:3]]], run_.block_size)
        return model_fn(meta, run_.kv_caches)

    with torch.no_grad():
        expected = run(lambda m, kv: whole.compute_logits(whole(ids, pos, m, kv)))
        staged = run(lambda m, kv: last.compute_logits(
            last(None, pos, m, kv[1:], hidden_states=first(ids, pos, m, kv[:1]))))
    torch.testing.assert_close(staged, expected)


def test_missing_weights_are_reported(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    files = resolve_model(str(path))
    model = build_model(files.config, attention_backend="reference")
    weights = [(n, t) for n, t in files.weights() if "layers.1.mlp" not in n]
    with pytest.raises(ValueError, match="layers.1.mlp"):
        model.load_weights(weights)


def test_unsupported_architecture_is_a_config_error(tmp_path):
    config = dict(resolve_model(str(make_tiny_checkpoint(tmp_path, "llama"))).config)
    config["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        build_model(config)



def test_query_heads_that_do_not_share_key_value_heads_evenly_are_a_config_error(tmp_path):
    """Else the first prefill fails deep in attention with a shape mismatch."""
    config = dict(resolve_model(str(make_tiny_checkpoint(tmp_path, "llama"))).config)
    config["num_key_value_heads"] = 2 * config["num_attention_heads"]
    with pytest.raises(ConfigError, match=r"^num_attention_heads \(\d+\) is not a multiple "
                                          r"of num_key_value_heads \(\d+\)$"):
        build_model(config)

def test_embedded_smollm2_matches_transformers():
    """SmolLM2-135M-Instruct from the embedded GGUF: our converted checkpoint in the paged
    model against transformers reading the same GGUF itself."""
    from tiny_models import embedded_files, transformers_gguf_reference

    files = embedded_files()
    _, _, reference = transformers_gguf_reference()
    model = build_model(files.config, dtype=torch.float32, attention_backend="reference")
    model.load_weights(files.weights())
    tok = files.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                          add_special_tokens=False)
               for text in ("What is the capital of France?", "Write a haiku about rain.")]
    n_new = 10
    outputs, logits = PagedRun(model, files.config, block_size=16, chunk=24).generate(
        prompts, n_new)
    for prompt, out, got in zip(prompts, outputs, logits, strict=True):
        assert until_eos(out, files.config["eos_token_id"]) == hf_greedy(reference, prompt, n_new)
        with torch.no_grad():
            expected = reference(torch.tensor([prompt + out[:-1]])).logits[0].float()
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
    assert "Paris" in tok.decode(outputs[0])


def test_embedded_smollm2_in_bf16_tracks_fp32():
    """The bf16 engine on whatever GEMM and kernels this CPU takes (oneDNN bf16, or MKL's
    fp32 GEMM and SDPA on an AVX2-only CPU): its logits stay within bf16's rounding of the
    fp32 model's and its greedy answers agree."""
    from tiny_models import embedded_files

    files = embedded_files()
    tok = files.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                          add_special_tokens=False)
               for text in ("What is the capital of France?", "Write a haiku about rain.")]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(files.config, dtype=dtype, attention_backend="reference")
        model.load_weights(files.weights())
        runs[dtype] = PagedRun(model, files.config, block_size=16, chunk=24,
                               dtype=dtype).generate(prompts, 12)
    (outs32, logits32), (outs16, logits16) = runs[torch.float32], runs[torch.bfloat16]
    assert "Paris" in tok.decode(outs16[0])
    for prompt, out32, out16, exact, rounded in zip(prompts, outs32, outs16, logits32,
                                                    logits16, strict=True):
        pairs = enumerate(zip(out32, out16, strict=False))  # EOS may end one earlier
        same = next((i for i, (a, b) in pairs if a != b), min(len(out32), len(out16)))
        assert same >= 4, (tok.decode(out32), tok.decode(out16))
        rows = len(prompt) + same  # positions whose inputs are the same in both runs
        error = (exact[:rows] - rounded[:rows]).abs()
        # measured: mean 0.16-0.21 and max 1.2-1.5 against a logit std of 6.8-8.0, top
        # tokens equal on 98-100% of positions (oneDNN bf16 and MKL fp32 alike)
        assert error.mean() < 0.05 * exact.std()
        assert error.max() < 0.4 * exact.std()
        agree = (exact[:rows].argmax(-1) == rounded[:rows].argmax(-1)).float().mean()
        assert agree >= 0.95
