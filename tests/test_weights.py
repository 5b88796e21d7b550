"""kvmem.spec.weights: exact bytes from safetensors headers, and estimates from the config."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvmem.errors import ConfigError
from kvmem.plan import EngineSettings, Layout, plan
from kvmem.spec import catalog, load_spec, spec_from_config
from kvmem.spec.weights import estimate_total_params, weight_breakdown, weight_bytes_per_rank

TINY = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 32, "intermediate_size": 16,
        "max_position_embeddings": 128, "torch_dtype": "float32"}


def _tensors(tied=False):
    f = np.float32
    t = {"model.embed_tokens.weight": np.zeros((32, 8), f), "model.norm.weight": np.zeros(8, f)}
    for i in range(3):  # layer 2 is beyond num_hidden_layers (e.g. multi-token prediction)
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = np.zeros((8, 8), f)
        t[f"model.layers.{i}.self_attn.k_proj.weight"] = np.zeros((4, 8), f)
        t[f"model.layers.{i}.self_attn.v_proj.weight"] = np.zeros((4, 8), f)
        t[f"model.layers.{i}.mlp.down_proj.weight"] = np.zeros((8, 16), f)
        t[f"model.layers.{i}.input_layernorm.weight"] = np.zeros(8, f)
    if not tied:
        t["lm_head.weight"] = np.zeros((32, 8), f)
    return t


@pytest.fixture
def checkpoint(tmp_path):
    tensors = _tensors()
    half = sorted(tensors)[: len(tensors) // 2]  # two shards, like a real checkpoint
    save_file({k: tensors[k] for k in half}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in half},
              tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_exact_bytes_per_stage_from_headers(checkpoint):
    spec = load_spec(checkpoint)
    layer = (64 + 32 + 32 + 128) * 4 + 8 * 4  # matrices + the norm
    embed = head = 32 * 8 * 4
    assert weight_bytes_per_rank(spec, [0], 1, True, False, checkpoint) == layer + embed
    assert weight_bytes_per_rank(spec, [1], 1, False, True, checkpoint) == layer + head + 8 * 4
    both = weight_bytes_per_rank(spec, [0, 1], 1, True, True, checkpoint)
    assert both == 2 * layer + embed + head + 8 * 4


def test_exact_bytes_split_matrices_over_tp_and_keep_norms_whole(checkpoint):
    spec = load_spec(checkpoint)
    tp2 = weight_bytes_per_rank(spec, [0], 2, False, False, checkpoint)
    assert tp2 == (64 + 32 + 32 + 128) * 4 // 2 + 8 * 4
    # tp 4 exceeds the 2 KV heads: k/v projections are replicated (one head per rank)
    tp4 = weight_bytes_per_rank(spec, [0], 4, False, False, checkpoint)
    assert tp4 == (64 + 128) * 4 // 4 + (32 + 32) * 4 // 2 + 8 * 4


def test_tied_embeddings_count_once_but_the_last_stage_needs_a_copy(tmp_path):
    save_file(_tensors(tied=True), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "tie_word_embeddings": True}))
    spec = load_spec(tmp_path)
    embed = 32 * 8 * 4
    one_stage = weight_breakdown(spec, 1, tmp_path)
    assert one_stage.tied
    first = one_stage.stage_bytes([0], True, False)
    last = one_stage.stage_bytes([1], False, True)
    whole = one_stage.stage_bytes([0, 1], True, True)
    assert first + last == whole + embed  # with pp > 1 the embedding is held twice


def test_a_multimodal_checkpoints_vision_layers_are_not_decoder_layers(tmp_path):
    """Gemma 3's vision tower has layers too (``vision_tower.vision_model.encoder.layers.0``):
    they count once, with the first stage's other tensors, never as a decoder layer."""
    f = np.float32
    tensors = {name.replace("model.", "language_model.model.", 1): t
               for name, t in _tensors(tied=True).items()}
    vision = {"vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": np.zeros((8, 4), f),
              "vision_tower.vision_model.embeddings.patch_embedding.weight": np.zeros((8, 3), f),
              "multi_modal_projector.mm_input_projection_weight": np.zeros((8, 8), f)}
    save_file({**tensors, **vision}, tmp_path / "model.safetensors")
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {**TINY, "model_type": "gemma3_text", "sliding_window": 4}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    split = weight_breakdown(load_spec(tmp_path), 1, tmp_path)
    layer = (64 + 32 + 32 + 128) * 4 + 8 * 4
    assert split.per_layer == (layer, layer)
    assert split.embedding == 32 * 8 * 4
    assert split.other == (32 + 24 + 64) * 4


def test_only_the_header_is_read(tmp_path):
    # a header that promises 4 GiB of tensor data the file does not have
    header = json.dumps({"model.layers.0.mlp.up_proj.weight": {
        "dtype": "BF16", "shape": [65536, 32768], "data_offsets": [0, 65536 * 32768 * 2]}})
    raw = header.encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    spec = load_spec(tmp_path)
    assert weight_bytes_per_rank(spec, [0], 1, False, False, tmp_path) == 65536 * 32768 * 2


@pytest.mark.parametrize("content", [b"\x01", struct.pack("<Q", 10) + b"not json!!",
                                     struct.pack("<Q", 1 << 40)])
def test_broken_safetensors_file_is_a_config_error(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ConfigError, match="safetensors"):
        weight_breakdown(load_spec(tmp_path), 1, tmp_path)


def test_estimate_matches_published_parameter_counts():
    checked = 0
    for entry in catalog():
        if entry.total_params:
            est = estimate_total_params(load_spec(entry.hf_id))
            assert est == pytest.approx(entry.total_params, rel=0.03), entry.hf_id
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize(("name", "card_params"), [
    ("ibm-granite/granite-4.0-h-small", 32e9), ("ibm-granite/granite-4.0-h-tiny", 7e9)])
def test_granite_moe_counts_its_shared_mlp(name, card_params):
    # Granite MoE names its shared MLP's size shared_intermediate_size; without it the
    # estimate falls 0.75B (Small) short of the card's rounded total
    assert estimate_total_params(load_spec(name)) == pytest.approx(card_params, rel=0.02)


def test_estimate_of_a_dense_model_counts_every_projection():
    spec = spec_from_config(TINY)
    h, i, v = 8, 16, 32
    per_layer = 2 * h * h + 2 * h * 4 + 3 * h * i + 2 * h  # q,o (8x8) + k,v (8x4) + mlp + norms
    assert estimate_total_params(spec) == 2 * per_layer + 2 * v * h + h


def test_quantised_checkpoints_use_their_bits():
    ds = load_spec("deepseek-ai/DeepSeek-V3")  # fp8 linear layers, bf16 embeddings
    total = weight_breakdown(ds, 1).total
    params = estimate_total_params(ds)
    assert params * 1.0 < total < params * 1.02
    oss = load_spec("openai/gpt-oss-20b")  # MXFP4 experts only, the rest bf16
    gib = weight_breakdown(oss, 1).total / (1 << 30)
    assert 12 < gib < 14


def test_tensor_parallel_roughly_halves_the_estimate():
    spec = load_spec("meta-llama/Llama-3.1-8B-Instruct")
    one, two = weight_breakdown(spec, 1).total, weight_breakdown(spec, 2).total
    assert one / 2 <= two < one / 2 * 1.001


def test_llama3_8b_estimate_matches_the_logged_14_96_gib():
    gib = weight_breakdown(load_spec("meta-llama/Meta-Llama-3-8B"), 1).total / (1 << 30)
    assert gib == pytest.approx(14.96, abs=0.01)


def test_planner_uses_exact_weights_from_a_checkpoint(checkpoint):
    spec = load_spec(checkpoint)
    settings = EngineSettings(max_model_len=128)
    exact = plan(spec, Layout(gpu_memory_bytes=1 << 30), settings, checkpoint_dir=checkpoint)
    assert exact.ranks[0].weights_bytes == weight_bytes_per_rank(spec, [0, 1], 1, True, True,
                                                                 checkpoint)
