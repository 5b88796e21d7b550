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
