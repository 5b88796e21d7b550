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


def test_what_is_read_from_a_model_directory_is_bounded(tmp_path):
    """A model directory's JSON files are read with a bound: a huge config.json or a
    tokenizer_config.json that is a device is a one-line error, not a read without end."""
    from kvmem.engine.tokenizer import Tokenizer

    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "config.json").rename(path / "config.json.orig")
    with open(path / "config.json", "wb") as f:
        f.truncate(1 << 30)  # sparse
    with pytest.raises(KvmemError, match="config.json: larger than 64.00 MiB"):
        resolve_model(str(path))
    (path / "config.json.orig").replace(path / "config.json")
    (path / "tokenizer_config.json").unlink()
    (path / "tokenizer_config.json").symlink_to("/dev/zero")
    with pytest.raises(KvmemError, match="tokenizer_config.json: not a regular file"):
        Tokenizer.from_dir(path)
    (path / "tokenizer_config.json").unlink()
    (path / "tokenizer.json").unlink()
    with open(path / "tokenizer.json", "wb") as f:
        f.truncate(300 << 20)  # sparse
    with pytest.raises(KvmemError, match="tokenizer.json: larger than 256.00 MiB"):
        Tokenizer.from_dir(path)


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


_GGUF_LAYER_NAMES = {hf: g for g, hf in gguf_convert._LAYER_NAMES.items()}


def write_tiny_gguf(model_dir, out_path, arch: str) -> None:
    """A GGUF (F32 tensors, gpt2 byte-level tokenizer) of a tiny checkpoint, written the way
    llama.cpp's converter lays out a Qwen model (no q/k row permutation)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted({**vocab["model"]["vocab"],
                     **{t["content"]: t["id"] for t in vocab["added_tokens"]}}.items(),
                    key=lambda kv: kv[1])
    special = {t["id"] for t in vocab["added_tokens"]}
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in tokens])
    w.add_token_types([3 if i in special else 1 for _, i in tokens])
    w.add_token_merges([])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    globals_ = {hf: g for g, hf in gguf_convert._GLOBAL_NAMES.items()}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name in globals_:
            gguf_name = globals_[name]
        else:  # model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight
            _, _, layer, *rest = name.split(".")
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
        w.add_tensor(gguf_name, tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_qwen3_gguf_gives_the_tokens_of_its_safetensors(tmp_path, monkeypatch):
    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path / "cache"))
    source = make_tiny_checkpoint(tmp_path, "qwen3")
    path = tmp_path / "tiny-qwen3.gguf"
    write_tiny_gguf(source, path, "qwen3")
    prompts = [[5, 9, 77, 200], list(range(30, 50))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def tokens(model: str) -> list[list[int]]:
        llm = LLM(model, kv_cache_memory_bytes=1 << 20, max_model_len=64)
        return [o.token_ids for o in llm.generate(prompts, params)]

    converted = resolve_model(str(path)).config
    assert converted["architectures"] == ["Qwen3ForCausalLM"]
    assert converted["tie_word_embeddings"] is True and converted["head_dim"] == 32
    assert tokens(str(path)) == tokens(str(source))
