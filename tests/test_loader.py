"""Loaders: GGUF conversion (against transformers' own GGUF reader), the conversion cache,
checkpoint directories (single file and sharded index), and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import embedded_files, make_tiny_checkpoint, transformers_gguf_reference

from kvmem.engine.loader import ModelLoadError, gguf_convert, resolve_model
from kvmem.errors import KvmemError


def test_embedded_model_is_the_documented_smollm2():
    config = embedded_files().config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == \
        (30, 576, 9, 3, 64, 49152)
    assert config["tie_word_embeddings"] is True


def test_embedded_weights_equal_transformers_gguf_reader():
    """Every tensor (dequantised, q/k rows un-permuted) equals transformers' reading."""
    hf_config, reference, _ = transformers_gguf_reference()
    ours = dict(embedded_files().weights())
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    config = embedded_files().config
    for key in ("rms_norm_eps", "max_position_embeddings", "intermediate_size"):
        assert config[key] == getattr(hf_config, key)
    assert config["rope_theta"] == hf_config.rope_parameters["rope_theta"]


def test_unpermute_inverts_llama_cpp_row_order():
    heads, head_dim, cols = 3, 8, 5
    weight = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's order: per head, the two rotary halves interleaved row by row
    permuted = (weight.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
                .reshape(weight.shape))
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(gguf_convert.unpermute_rotary_rows(permuted, heads), weight)


def test_gguf_conversion_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    first = resolve_model("smollm2")
    assert first.path.parent == tmp_path / "models"
    assert first.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert sorted(p.name for p in first.path.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    def fail(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    again = resolve_model(None)
    assert again.path == first.path
    assert not list((tmp_path / "models").glob(".converting-*"))


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    weights = dict(resolve_model(str(path)).weights())
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():
        save_file({n: weights[n] for n in members}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, members in shards.items() for n in members}}))
    loaded = dict(resolve_model(str(path)).weights())
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[n], weights[n]) for n in names)


def test_sharded_index_naming_a_missing_file_is_an_error(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(ModelLoadError, match="gone.safetensors"):
        resolve_model(str(path))


@pytest.mark.parametrize("remove, message", [
    ("config.json", "no config.json"), ("tokenizer.json", "no tokenizer.json"),
    ("model.safetensors", "no \\*.safetensors"),
])
def test_incomplete_checkpoint_dirs_are_clear_errors(tmp_path, remove, message):
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / remove).unlink()
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(str(path))


def test_bad_sources_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(KvmemError, match="not found"):
        resolve_model(str(tmp_path / "nowhere"))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model"):
        resolve_model(str(text))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_model(str(broken))
    assert not list((tmp_path / "cache" / "models").glob("*"))
