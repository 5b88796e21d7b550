"""kvmem.spec: config parsing, layer kinds, sharding rules and the catalog."""

import importlib
import json
import re

import pytest

from kvmem.errors import ConfigError, UnknownModelError
from kvmem.spec import AttentionKind, catalog, load_spec, spec_from_config, text_config
from kvmem.spec.dtypes import dtype_bytes, resolve_kv_dtype
from kvmem.spec.layout import StateKind


def test_catalog_has_25_models_and_all_parse():
    entries = catalog()
    assert len(entries) >= 25
    for e in entries:
        spec = load_spec(e.hf_id)
        assert spec.num_layers == len(spec.layers) > 0
        assert load_spec(e.aliases[0]).num_layers == spec.num_layers


@pytest.mark.parametrize("columns", ["80", "40"])
def test_models_table_shows_full_ids_and_aliases(monkeypatch, capsys, columns):
    from kvmem.cli import main

    monkeypatch.setenv("COLUMNS", columns)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    words = set(out.replace(",", " ").split())
    for e in catalog():
        assert e.hf_id in words
        assert set(e.aliases) <= words, e.aliases


def test_explicit_head_dim_wins_over_hidden_over_heads():
    spec = load_spec("Qwen/Qwen3-0.6B")  # hidden 1024 / 16 heads = 64, but head_dim is 128
    assert spec.head_dim == 128
    assert spec.kv_bytes_per_token(dtype_bytes=2) == 28 * 2 * 8 * 128 * 2


def test_qwen3_32b_fp8_is_2048_bytes_per_token_per_layer():
    spec = load_spec("qwen3-32b")
    assert spec.layers[0].bytes_per_token(tp=1, dtype_bytes=1) == 2048


def test_gqa_heads_replicate_when_tp_exceeds_kv_heads():
    layer = load_spec("Qwen/Qwen2.5-7B-Instruct").layers[0]  # 4 KV heads
    assert layer.kv_heads_on_rank(2) == 2
    assert layer.kv_heads_on_rank(8) == 1
    assert layer.bytes_per_token(8, 2) == layer.bytes_per_token(4, 2)


def test_mla_does_not_shrink_with_tp():
    spec = load_spec("deepseek-ai/DeepSeek-V3")
    assert spec.attention_kinds == {AttentionKind.MLA}
    per_layer = (512 + 64) * 2
    assert spec.kv_bytes_per_token(tp=1, dtype_bytes=2) == 61 * per_layer
    assert spec.kv_bytes_per_token(tp=8, dtype_bytes=2) == 61 * per_layer


@pytest.mark.parametrize(
    "model, sliding, full, window",
    [
        ("google/gemma-3-27b-it", 52, 10, 1024),
        ("google/gemma-2-9b-it", 21, 21, 4096),
        ("openai/gpt-oss-20b", 12, 12, 128),
        ("microsoft/Phi-3-mini-4k-instruct", 32, 0, 2047),
    ],
)
def test_sliding_window_patterns(model, sliding, full, window):
    spec = load_spec(model)
    kinds = [layer.kind for layer in spec.layers]
    assert kinds.count(AttentionKind.SLIDING) == sliding
    assert kinds.count(AttentionKind.FULL) == full
    sliding_layers = [layer for layer in spec.layers if layer.kind is AttentionKind.SLIDING]
    assert all(layer.window == window for layer in sliding_layers)


def test_gemma3_every_sixth_layer_is_global():
    spec = load_spec("google/gemma-3-4b-it")
    assert spec.layers[5].kind is AttentionKind.FULL
    assert spec.layers[0].kind is AttentionKind.SLIDING


# gemma-3-4b-it's config.json (vision_config shortened): its text_config names only sizes,
# window and RoPE scaling; transformers' Gemma3TextConfig supplies the rest
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27},
}


def test_gemma3_nested_config_takes_the_text_models_defaults():
    spec = spec_from_config(GEMMA3_4B_IT)
    assert spec.architecture == "Gemma3ForConditionalGeneration"
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (34, 2560, 262_208)
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (8, 4, 256)
    assert spec.tie_word_embeddings and spec.dtype == "bfloat16"
    assert [layer.kind for layer in spec.layers[:6]] == [AttentionKind.SLIDING] * 5 + [
        AttentionKind.FULL]
    assert spec.layers == load_spec("google/gemma-3-4b-it").layers
    config = text_config(GEMMA3_4B_IT)
    assert config["query_pre_attn_scalar"] == 256 and config["rope_local_base_freq"] == 10_000
    assert config["rope_scaling"] == {"factor": 8.0, "rope_type": "linear"}


def test_llama4_chunked_local_attention():
    spec = load_spec("meta-llama/Llama-4-Scout-17B-16E")
    kinds = [layer.kind for layer in spec.layers]
    assert kinds.count(AttentionKind.CHUNKED) == 36 and kinds.count(AttentionKind.FULL) == 12
    assert spec.layers[0].window == 8192


def test_qwen2_sliding_window_off_means_full():
    spec = spec_from_config({
        "model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "sliding_window": 32, "use_sliding_window": False,
    })
    assert spec.attention_kinds == {AttentionKind.FULL}


def test_kv_groups_are_equal_sized_and_cover_all_layers():
    spec = load_spec("google/gemma-3-27b-it")
    groups = spec.kv_groups()
    covered = sorted(i for g in groups for i in g.layers)
    assert covered == list(range(62))
    assert max(len(g.layers) for g in groups) == 10  # the 10 global layers set the group size
    full = [g for g in groups if g.kind is AttentionKind.FULL]
    assert len(full) == 1


def test_sliding_group_needs_only_the_window():
    group = next(g for g in load_spec("openai/gpt-oss-20b").kv_groups()
                 if g.kind is AttentionKind.SLIDING)
    assert group.blocks_per_request(100_000, 16, 2048) == (128 - 1 + 2048 + 15) // 16 + 1
    assert group.blocks_per_request(32, 16, 2048) == 2


def test_kv_dtype_auto_follows_model_and_fp8_is_one_byte():
    assert resolve_kv_dtype("auto", "bfloat16") == "bfloat16"
    assert dtype_bytes(resolve_kv_dtype("fp8", "bfloat16")) == 1
    assert dtype_bytes("fp8_e5m2") == 1
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_kv_dtype("int3", "bfloat16")


def test_unknown_model_suggests_close_names():
    with pytest.raises(UnknownModelError, match="did you mean"):
        load_spec("qwen3-32")

@pytest.mark.parametrize(("name", "kinds", "kv_bf16"), [
    # the layer mixes the configs state (layer_types, hybrid_override_pattern)
    ("qwen3.5-27b", {"full_attention": 16, "linear_attention": 48}, 16 * 2 * 4 * 256 * 2),
    ("nemotron-nano-9b-v2", {"full_attention": 4, "linear_attention": 27, "none": 25},
     4 * 2 * 8 * 128 * 2),
    ("glm-4.5", {"full_attention": 92}, 376_832),  # a KV calculator's published figure
    ("deepseek-r1", {"mla": 61}, 61 * 576 * 2),
    ("llama-3.3-70b", {"full_attention": 80}, 80 * 2 * 8 * 128 * 2),
    ("mistral-small-3.2", {"full_attention": 40}, 40 * 2 * 8 * 128 * 2),
    ("granite-4.0-h-small", {"full_attention": 4, "linear_attention": 36}, 4 * 2 * 8 * 128 * 2),
    ("granite-4.0-h-tiny", {"full_attention": 4, "linear_attention": 36}, 4 * 2 * 4 * 128 * 2),
])
def test_this_seasons_catalog_models_have_their_layer_mix(name, kinds, kv_bf16):
    spec = load_spec(name)
    counts: dict[str, int] = {}
    for layer in spec.layers:
        counts[layer.kind.value] = counts.get(layer.kind.value, 0) + 1
    assert counts == kinds
    assert spec.kv_bytes_per_token(dtype_bytes=2) == kv_bf16



@pytest.fixture
def waiting_entry(monkeypatch):
    """The catalog with one entry of an attention kind kvmem does not plan (MiniMax's
    lightning attention, a Llama-shaped config marked ``unplanned``)."""
    catalog_module = importlib.import_module("kvmem.spec.catalog")
    entry = catalog_module.CatalogEntry(
        "example/Lightning-1B", "Lightning-1B", ("lightning-1b",),
        {"model_type": "minimax", "num_hidden_layers": 4, "hidden_size": 256,
         "num_attention_heads": 4, "vocab_size": 1000}, None, "synthetic", None,
        "lightning attention layers")
    real = catalog_module._entries()
    caches = (catalog_module.catalog, catalog_module.unplanned, catalog_module._index)
    monkeypatch.setattr(catalog_module, "_entries", lambda: (*real, entry))
    for cached in caches:
        cached.cache_clear()
    yield entry
    monkeypatch.undo()
    for cached in caches:
        cached.cache_clear()


def test_a_known_model_kvmem_cannot_plan_yet_says_so_in_one_line(capsys, waiting_entry):
    """Catalog entries whose attention kind is not planned are named, never planned as
    the wrong layers: the CLI exits 2 with the kind, `kvmem models` lists them apart."""
    from kvmem.cli import main
    from kvmem.spec.catalog import unplanned

    waiting = unplanned()
    assert waiting_entry in waiting
    assert not {e.hf_id for e in waiting} & {e.hf_id for e in catalog()}
    for entry in waiting:
        with pytest.raises(ConfigError, match=f"cannot plan {re.escape(entry.unplanned)} yet"):
            load_spec(entry.aliases[0])
        assert main(["plan", entry.hf_id, "--gpu", "H100"]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert main(["models", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert len(rows) == len(catalog()) + len(waiting)
    assert all(rows[e.hf_id]["kv_bytes_per_token_bf16"] is None
               and rows[e.hf_id]["unplanned"] == e.unplanned for e in waiting)


def test_kimi_linear_is_planned_with_its_kda_and_mla_layers():
    """Kimi-Linear-48B's catalog config: 20 KDA layers and MLA at layers 4, 8, ..., 24, 27
    (1-based), its latent kv_lora_rank + qk_rope_head_dim."""
    from kvmem.spec.catalog import unplanned

    assert "moonshotai/Kimi-Linear-48B-A3B-Instruct" not in {e.hf_id for e in unplanned()}
    spec = load_spec("kimi-linear")
    mla = [lay.index + 1 for lay in spec.layers if lay.kind is AttentionKind.MLA]
    assert mla == [4, 8, 12, 16, 20, 24, 27]
    assert spec.kv_bytes_per_token(dtype_bytes=2) == 7 * (512 + 64) * 2
    state = spec.layers[0].state
    assert state is not None and state.kind is StateKind.KDA
    # conv: q, k, v channels over kernel-1 rows; recurrent (heads, head_dim, head_dim)
    assert state.shapes(2) == [((3, 3 * 32 * 128 // 2), False), ((16, 128, 128), True)]


def test_bad_configs_give_one_line_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_spec(bad)
    bad.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match="missing num_hidden_layers"):
        load_spec(tmp_path)
    bad.write_text(json.dumps({"num_hidden_layers": 0, "hidden_size": 64,
                               "num_attention_heads": 4, "vocab_size": 10}))
    with pytest.raises(ConfigError, match="positive integer"):
        load_spec(bad)
    with pytest.raises(ConfigError, match="no config.json"):
        load_spec(tmp_path / "..")


def _config(**fields) -> dict:
    base = {"architectures": ["X"], "num_hidden_layers": 6, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 100}
    return {**base, **fields}


def test_gemma3n_shared_layers_read_the_last_sliding_and_full_layer_and_keep_no_kv():
    # vLLM's Gemma3nAttention: a shared sliding layer reads the layer two before the first
    # shared one, a shared full layer the one just before
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(15)]
    spec = spec_from_config(_config(model_type="gemma3n_text", num_hidden_layers=15,
                                    layer_types=types, sliding_window=512,
                                    num_kv_shared_layers=5))
    assert [lay.kv_source for lay in spec.layers[10:]] == [8, 8, 8, 8, 9]
    assert all(lay.kv_source is None for lay in spec.layers[:10])
    assert sorted(i for g in spec.kv_groups() for i in g.layers) == list(range(10))
    assert spec.kv_bytes_per_token(dtype_bytes=2) == 10 * 2 * 2 * 16 * 2


def test_gemma4_shared_layers_read_the_last_earlier_layer_of_their_type():
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)]
    spec = spec_from_config(_config(model_type="gemma4_text", num_hidden_layers=12,
                                    layer_types=types, sliding_window=512,
                                    num_kv_shared_layers=4))
    assert [lay.kv_source for lay in spec.layers[8:]] == [7, 7, 7, 5]


def test_gemma4_full_layers_take_their_per_layer_head_size():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    spec = spec_from_config(_config(model_type="gemma4_text", layer_types=types,
                                    sliding_window=512, per_layer_config={"05": {"head_dim": 32}}))
    assert [lay.head_dim for lay in spec.layers] == [16] * 5 + [32]


@pytest.mark.parametrize(("fields", "full"), [
    ({"global_head_dim": 64, "num_global_key_value_heads": 1, "attention_k_eq_v": True},
     (1, 64)),
    ({"global_head_dim": 64, "num_global_key_value_heads": 1}, (2, 64)),  # no K = V: own heads
    ({}, (2, 512)),  # transformers' default global_head_dim
])
def test_gemma4_published_config_gives_full_layers_their_global_shape(fields, full):
    # a config.json as published (google/gemma-4-31B-it) holds no per_layer_config:
    # transformers builds it from global_head_dim and, with attention_k_eq_v,
    # num_global_key_value_heads, and vLLM sizes each layer's KV from that
    types = ["sliding_attention"] * 5 + ["full_attention"]
    spec = spec_from_config(_config(model_type="gemma4_text", layer_types=types,
                                    sliding_window=512, **fields))
    assert [(lay.num_kv_heads, lay.head_dim) for lay in spec.layers] == [(2, 16)] * 5 + [full]


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_granite_4_0_h_small_from_the_catalog_is_planned_under_vllms_mamba_rules(version):
    """Attention at layers 5, 15, 25 and 35, Mamba2 on the other 36 (128 heads of 64, state
    128, 1 group, conv 4, inner 2 x 4096). The config names no mamba_ssm_cache_dtype, so the
    state is bfloat16 throughout and raises the block to 528 tokens; the 36 Mamba2 layers
    make 9 groups of 4 beside the attention group."""
    from math import ceil

    from kvmem.plan import EngineSettings, Layout, plan

    spec = load_spec("ibm-granite/granite-4.0-h-small")
    assert [i for i, lay in enumerate(spec.layers)
            if lay.kind is AttentionKind.FULL] == [5, 15, 25, 35]
    state = spec.layers[0].state
    assert state.kind is StateKind.MAMBA2
    assert state.shapes(1) == [((3, 8192 + 2 * 128), False), ((128, 64, 128), True)]
    gib = 1 << 30
    p = plan(spec, Layout(), EngineSettings(vllm_version=version, kv_cache_memory_bytes=8 * gib,
                                            max_model_len=32768))
    token = 2 * 8 * 128 * 2
    block = 16 * ceil((3 * 8448 + 128 * 64 * 128) * 2 / (16 * token))
    assert p.engine.block_size == block == 528
    assert p.engine.num_kv_groups == 10
    assert p.engine.num_blocks == 8 * gib // (4 * block * token)
    assert p.engine.max_concurrency == p.engine.num_blocks / (ceil(32768 / block) + 9 * 3)


def test_gemma4_31b_from_the_catalog_is_planned():
    spec = load_spec("google/gemma-4-31B-it")
    shapes = {(lay.kind, lay.num_kv_heads, lay.head_dim) for lay in spec.layers}
    assert shapes == {(AttentionKind.SLIDING, 16, 256), (AttentionKind.FULL, 4, 512)}
    # 50 sliding layers of 16 x 256 and 10 full of 4 x 512, K and V in bf16
    assert spec.kv_bytes_per_token(dtype_bytes=2) == 50 * 2 * 16 * 256 * 2 + 10 * 2 * 4 * 512 * 2


def test_too_many_shared_layers_is_one_line_error():
    with pytest.raises(ConfigError, match="num_kv_shared_layers"):
        spec_from_config(_config(model_type="gemma4_text", num_kv_shared_layers=6))


DEEPSEEK_V32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "num_hidden_layers": 4, "hidden_size": 7168, "num_attention_heads": 128,
                "vocab_size": 129280, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "q_lora_rank": 1536, "index_topk": 2048, "index_head_dim": 128}


@pytest.mark.parametrize(("kv_dtype", "latent"), [(2, 576 * 2), (1, 656)])
def test_deepseek_v32_keeps_its_indexer_and_fp8_ds_mla(kv_dtype, latent):
    # vLLM: the indexer caches 128 fp8 values and a float32 scale per token and layer;
    # sparse MLA stores 8-bit KV as fp8_ds_mla, 656 bytes per token
    spec = spec_from_config(DEEPSEEK_V32)
    assert [lay.index_bytes for lay in spec.layers] == [132] * 4
    assert spec.layers[0].bytes_per_token(8, kv_dtype) == latent + 132


def test_dense_mla_in_fp8_is_its_latent_in_bytes():
    dense = {k: v for k, v in DEEPSEEK_V32.items() if not k.startswith("index")}
    assert spec_from_config(dense).layers[0].bytes_per_token(1, 1) == 576


@pytest.mark.parametrize(("fields", "indexed"), [
    ({"index_topk_freq": 2}, [0, 1, 3]),  # from index_skip_topk_offset 2: every other
    ({"index_topk_pattern": "FSSF"}, [0, 3]),
])
def test_deepseek_indexer_skips_the_layers_its_pattern_names(fields, indexed):
    spec = spec_from_config({**DEEPSEEK_V32, **fields})
    assert [lay.index for lay in spec.layers if lay.index_bytes] == indexed
    assert all(lay.sparse for lay in spec.layers)


def test_gpt_oss_sinks_leave_its_sliding_and_full_layers_as_they_are():
    # the attention sinks are per-head logits (weights), not KV: vLLM's layers build plain
    # sliding-window and full-attention specs
    types = ["sliding_attention", "full_attention"] * 3
    spec = spec_from_config(_config(model_type="gpt_oss", layer_types=types,
                                    sliding_window=128, num_key_value_heads=8, head_dim=64))
    assert [(lay.kind, lay.window) for lay in spec.layers[:2]] == [
        (AttentionKind.SLIDING, 128), (AttentionKind.FULL, None)]
    assert spec.kv_bytes_per_token(dtype_bytes=2) == 6 * 2 * 8 * 64 * 2


def test_deepseek_v32_mtp_layers_index_even_where_the_last_layer_does_not():
    from kvmem.spec.speculative import with_speculative

    spec = spec_from_config({**DEEPSEEK_V32, "index_topk_pattern": "FFFS",
                             "num_nextn_predict_layers": 1})
    drafted = with_speculative(spec, {"method": "mtp"})
    assert spec.layers[-1].index_bytes == 0
    assert [lay.index_bytes for lay in drafted.speculative.layers] == [132]
    assert drafted.speculative.num_speculative_tokens == 1  # vLLM: n_predict by default
