"""``--load-format dummy``: a model from its config alone, with seeded random weights."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_checkpoint

from kvmem.engine.config import EngineConfig
from kvmem.engine.llm import LLM
from kvmem.engine.loader import ModelLoadError, resolve_model
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import ConfigError


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A directory with the tiny qwen3 checkpoint's config and tokenizer, no weights."""
    full = make_tiny_checkpoint(tmp_path_factory.mktemp("full"), "qwen3")
    out = tmp_path_factory.mktemp("config-only")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((full / name).read_bytes())
    return out


def test_a_directory_without_weights_needs_the_dummy_format(config_only):
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        resolve_model(str(config_only))
    assert resolve_model(str(config_only), load_format="dummy").weight_files == []


def test_dummy_weights_are_seeded_and_drive_generation(config_only):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for seed in (0, 0, 1):
        llm = LLM(str(config_only), load_format="dummy", seed=seed,
                  kv_cache_memory_bytes=1 << 22)
        model = llm.engine.model_runner.model
        norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
        assert norms and all(bool((p == 1).all()) for p in norms)
        std = float(model.embed_tokens.weight.float().std())
        assert 0.015 < std < 0.025
        runs.setdefault(seed, []).append(
            llm.generate([[5, 6, 7, 8, 9]], params)[0].outputs[0].token_ids)
    assert runs[0][0] == runs[0][1]  # the same seed, the same weights
    assert runs[0][0] != runs[1][0]  # another seed, other weights (12 greedy tokens)
    assert len(set(runs[0][0])) > 1


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ConfigError, match="unknown load format 'pt'"):
        EngineConfig(load_format="pt")


@pytest.mark.parametrize("family,tp", [("qwen3", 2), ("qwen2", 2), ("llama", 4)])
def test_dummy_weights_do_not_depend_on_tensor_parallelism(family, tp):
    """Each rank's dummy shard is the slice of the tp-1 model's weight it would load
    from a checkpoint (qwen2: q/k/v biases; llama at tp 4: KV heads replicated)."""
    import torch
    from tiny_models import _BASE, FAMILIES

    from kvmem.engine.loader.dummy import initialize_dummy_weights
    from kvmem.engine.models import build_model

    config = {**_BASE, **FAMILIES[family], "model_type": family}

    def weights(tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
        model = build_model(config, tp_rank=tp_rank, tp_size=tp_size)
        for module in model.modules():  # read the weights as loaded, before CPU packing
            if hasattr(module, "pack_weight"):
                module.pack_weight = lambda: None
        initialize_dummy_weights(model, seed=3)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    whole = weights(0, 1)
    shards = [weights(r, tp) for r in range(tp)]
    q = config["num_attention_heads"] * 32 if family == "qwen3" else 64
    kv = q // config["num_attention_heads"] * config["num_key_value_heads"]
    for name, full in whole.items():
        parts = [s[name] for s in shards]
        if full.dim() < 2:
            continue
        if "qkv_proj" in name:
            qs, ks, vs = full.split([q, kv, kv])
            kv_shards = min(tp, config["num_key_value_heads"])
            for r, part in enumerate(parts):
                pq, pk, pv = part.split([q // tp, kv // kv_shards, kv // kv_shards])
                kr = r * kv_shards // tp
                assert torch.equal(pq, qs.chunk(tp)[r]), name
                assert torch.equal(pk, ks.chunk(kv_shards)[kr]), name
                assert torch.equal(pv, vs.chunk(kv_shards)[kr]), name
        elif "gate_up" in name:
            gate, up = full.chunk(2)
            for r, part in enumerate(parts):
                assert torch.equal(part, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])), name
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), full), name
        else:  # embedding, LM head: split by vocabulary rows
            assert torch.equal(torch.cat(parts)[:full.shape[0]], full), name
