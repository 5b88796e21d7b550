"""Linear-attention hybrids (Gated DeltaNet, Mamba2) read from their configs and planned
under vLLM's rules (kvmem.plan.vllm_mamba), without vLLM, and under kvmem's own engine's
(state groups, kvmem.plan.geometry.KVGeometry).

The expected figures are worked out by hand from vLLM 0.32's and 0.33's source (see
docs/plan.md, "Linear-attention states"); tests/test_plan_vllm_hybrid.py checks the same
rules against vLLM's own functions over a grid of tiny configs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from math import ceil

import pytest

from kvmem.errors import ConfigError
from kvmem.plan import EngineSettings, Layout, plan
from kvmem.plan.planner import engine_geometry
from kvmem.spec import AttentionKind, spec_from_config
from kvmem.spec.layout import StateKind

GiB = 1 << 30

# Qwen3-Coder-Next (Qwen3-Next-80B-A3B's shape): 48 layers, every fourth full attention
QWEN3_CODER_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
    "vocab_size": 151936, "max_position_embeddings": 262144, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hidden_size": 4096, "num_hidden_layers": 8, "hybrid_override_pattern": "M-M*M-ME",
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 21504, "vocab_size": 131072, "max_position_embeddings": 8192,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
    "conv_kernel": 4, "torch_dtype": "bfloat16",
}


def settings(version: str = "0.33", **kw) -> EngineSettings:
    return EngineSettings(vllm_version=version, kv_cache_memory_bytes=8 * GiB,
                          max_model_len=32768, max_num_seqs=256,
                          max_num_batched_tokens=8192, **kw)


def qwen3_coder_next_plan(version: str, **kw):
    return plan(spec_from_config(QWEN3_CODER_NEXT, "Qwen3-Coder-Next"), Layout(),
                settings(version, **kw))


# One Gated DeltaNet state on a rank in bf16: conv (4 - 1) x (2 x 16 x 128 + 32 x 128)
# and temporal 32 x 128 x 128; a full-attention token 2 x 2 heads x 256 x 2 bytes.
STATE = (3 * 8192 + 32 * 128 * 128) * 2
TOKEN = 2 * 2 * 256 * 2


@pytest.mark.parametrize(("version", "align", "checkpoint"), [("0.32", 16, 0),
                                                               ("0.33", 64, 1)])
def test_qwen3_coder_next_in_8_gib_is_planned_as_vllm_plans_it(version, align, checkpoint):
    """The block size rises until a page holds a state (0.33's FlashInfer GDN prefill also
    aligns it to 64 tokens), 36 GDN layers make 3 groups of 12 beside the 12 full ones, and
    a request holds its attention blocks and 2 (+1 checkpoint in 0.33) pages per GDN group."""
    p = qwen3_coder_next_plan(version)
    block = align * ceil(STATE / (align * TOKEN))
    assert p.engine.block_size == block  # 544 in 0.32, 576 in 0.33
    assert p.engine.num_kv_groups == 4
    bytes_per_block = 12 * block * TOKEN
    blocks = 8 * GiB // bytes_per_block
    per_request = ceil(32768 / block) + 3 * (2 + checkpoint)
    assert p.engine.num_blocks == blocks
    assert p.engine.max_concurrency == blocks / per_request
    assert p.engine.kv_cache_size_tokens == int(blocks / per_request * 32768)
    assert p.engine.fits
    assert p.ranks[0].need_bytes_at_max_model_len == (per_request + 1) * bytes_per_block


def test_without_prefix_caching_a_request_holds_one_state_page_per_group():
    p = qwen3_coder_next_plan("0.33", enable_prefix_caching=False)
    block = 16 * ceil(STATE / (16 * TOKEN))  # no checkpoint alignment without align mode
    assert p.engine.block_size == block
    assert p.engine.max_concurrency == p.engine.num_blocks / (ceil(32768 / block) + 3)


def test_kvmem_plan_command_plans_qwen3_coder_next(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_CODER_NEXT))
    run = subprocess.run([sys.executable, "-m", "kvmem", "plan", str(config),
                          "--max-model-len", "32768", "--kv-cache-memory-bytes", "8GiB",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    engine = json.loads(run.stdout)["engine"]
    assert engine["fits"] and engine["block_size"] == 576
    assert engine["max_concurrency"] > 9


def test_kvmem_plan_for_kvmems_engine_keeps_states_in_raised_blocks(tmp_path):
    """``--engine kvmem``: the block size rises until a page holds a state (in elements,
    the engine's cache dtype: 544 tokens), the 36 GDN layers are 3 state groups of 12,
    and nothing is reserved apart from the blocks: every byte of the 8 GiB is blocks."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_CODER_NEXT))
    run = subprocess.run([sys.executable, "-m", "kvmem", "plan", str(config),
                          "--max-model-len", "32768", "--kv-cache-memory-bytes", "8GiB",
                          "--max-num-seqs", "256", "--engine", "kvmem", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    engine, rank = out["engine"], out["ranks"][0]
    block = 16 * ceil(STATE / (16 * TOKEN))
    assert engine["rules"] == "kvmem" and engine["block_size"] == block == 544
    assert (engine["num_kv_groups"], engine["num_state_groups"]) == (4, 3)
    assert "state_bytes_reserved" not in rank
    assert rank["bytes_per_block"] == 12 * block * TOKEN
    assert rank["num_blocks"] == engine["num_blocks"] == 8 * GiB // (12 * block * TOKEN)
    assert engine["max_concurrency"] == engine["num_blocks"] / (ceil(32768 / block) + 3 * 2)


def test_gated_delta_net_state_is_split_across_tensor_parallel_ranks():
    spec = spec_from_config(QWEN3_CODER_NEXT)
    state = spec.layers[0].state
    assert spec.layers[3].kind is AttentionKind.FULL and state.kind is StateKind.GATED_DELTA_NET
    assert state.shapes(1) == [((3, 8192), False), ((32, 128, 128), True)]
    assert state.shapes(2, num_spec=2) == [((5, 4096), False), ((16, 128, 128), True)]
    with pytest.raises(ConfigError, match="tensor parallel size 3"):
        state.shapes(3)


def test_nemotron_h_pattern_gives_mamba2_attention_and_stateless_layers():
    spec = spec_from_config(NEMOTRON_H)
    assert [lay.kind for lay in spec.layers] == [
        AttentionKind.LINEAR, AttentionKind.NONE, AttentionKind.LINEAR, AttentionKind.FULL,
        AttentionKind.LINEAR, AttentionKind.NONE, AttentionKind.LINEAR, AttentionKind.NONE]
    state = spec.layers[0].state
    assert state.kind is StateKind.MAMBA2 and state.ssm_dtype == "float32"
    # conv channels: 128 x 64 + 2 x 8 groups x 128; at tp 16 the 8 groups are repeated
    assert state.shapes(1) == [((3, 8192 + 2 * 8 * 128), False), ((128, 64, 128), True)]
    assert state.shapes(16)[0] == ((3, (8192 + 2 * 16 * 128) // 16), False)


def test_nemotron_h_plan_groups_four_mamba_layers_and_one_attention_layer():
    """4 Mamba2 layers and 1 attention layer: groups of 1, the state (conv in bf16, SSM in
    float32) padded to the attention page at the raised block size; with prefix caching a
    Mamba2 layer holds 2 pages and a checkpoint page."""
    p = plan(spec_from_config(NEMOTRON_H), Layout(), settings())
    geometry = engine_geometry(spec_from_config(NEMOTRON_H), 1, 1, p.settings, "bfloat16")
    state = 3 * (8192 + 2048) * 2 + 128 * 64 * 128 * 4
    token = 2 * 8 * 128 * 2
    block = 16 * ceil(state / (16 * token))
    assert (geometry.mamba.state_bytes, p.engine.block_size) == (state, block)
    assert p.engine.num_kv_groups == 5
    assert p.engine.max_concurrency == p.engine.num_blocks / (ceil(32768 / block) + 4 * 3)


def test_granite_layer_types_and_bamba_attention_indices_name_the_mamba_layers():
    granite = {"model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 4,
               "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 100352,
               "layer_types": ["mamba", "mamba", "attention", "mamba"],
               "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128,
               "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
    spec = spec_from_config(granite)
    assert [lay.kind.value for lay in spec.layers] == [
        "linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert spec.layers[0].state.shapes(1)[0] == ((3, 2 * 1536 + 2 * 128), False)
    bamba = {**granite, "model_type": "bamba", "attn_layer_indices": [1]}
    del bamba["layer_types"]
    assert [lay.kind for lay in spec_from_config(bamba).layers][:2] == [
        AttentionKind.LINEAR, AttentionKind.FULL]


def test_a_state_field_missing_is_one_line_naming_it():
    broken = {k: v for k, v in NEMOTRON_H.items() if k != "ssm_state_size"}
    with pytest.raises(ConfigError, match="Mamba2 needs ssm_state_size"):
        spec_from_config(broken)


def test_on_vllms_cpu_platform_the_ssm_state_is_float32():
    """vLLM's CPU platform on an AVX512-BF16 host keeps SSM states in float32 unless a
    Gated DeltaNet state is asked for in bfloat16 or float16."""
    spec = spec_from_config(QWEN3_CODER_NEXT)
    cpu = engine_geometry(spec, 1, 1, settings(device="cpu", cpu_avx512_bf16=True),
                          "bfloat16")
    assert cpu.mamba.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 4
    kept = engine_geometry(spec, 1, 1, settings(device="cpu", cpu_avx512_bf16=True,
                                                mamba_ssm_cache_dtype="bfloat16"), "bfloat16")
    assert kept.mamba.state_bytes == STATE


def test_on_a_cpu_without_avx512_bf16_the_ssm_state_stays_as_the_model_sets_it():
    """AMD Zen 3 and other CPUs without AVX512-BF16: vLLM-CPU leaves the SSM dtype alone."""
    spec = spec_from_config(QWEN3_CODER_NEXT)
    cpu = engine_geometry(spec, 1, 1, settings(device="cpu", cpu_avx512_bf16=False),
                          "bfloat16")
    assert cpu.mamba.state_bytes == STATE


def test_this_hosts_cpu_decides_by_default(monkeypatch):
    from kvmem.plan import vllm_mamba

    spec = spec_from_config(QWEN3_CODER_NEXT)
    for has, ssm_bytes in ((True, 4), (False, 2)):
        monkeypatch.setattr(vllm_mamba, "cpu_avx512_bf16", lambda has=has: has)
        cpu = engine_geometry(spec, 1, 1, settings(device="cpu"), "bfloat16")
        assert cpu.mamba.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * ssm_bytes


def test_the_vllm_command_keeps_prefix_caching_off_and_the_state_dtypes():
    from kvmem.plan.flags import engine_command

    p = qwen3_coder_next_plan("0.33", enable_prefix_caching=False,
                              mamba_ssm_cache_dtype="float32")
    argv = engine_command(p, "vllm", "Qwen/Qwen3-Coder-Next").argv
    assert "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--mamba-ssm-cache-dtype") + 1] == "float32"
    assert "--mamba-cache-dtype" not in argv
    # a float32 temporal state needs a larger block: 16 x cdiv(3 x 8192 x 2 + 32 x 128 x
    # 128 x 4, 16 x 1024 x 2)
    assert p.engine.block_size == 16 * ceil((3 * 8192 * 2 + 32 * 128 * 128 * 4) / (16 * TOKEN))


def test_lfm2_short_convolutions_keep_a_conv_state_only():
    """LFM2's conv layers (``layer_types`` "conv") hold (conv_L_cache - 1) rows of conv_dim
    channels (``short_conv_state_shape``) in the model's dtype, and no checkpoint block."""
    lfm2 = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
            "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 65536, "conv_L_cache": 3, "conv_dim": 2048,
            "layer_types": ["conv", "conv", "full_attention", "conv"],
            "max_position_embeddings": 128000, "torch_dtype": "bfloat16"}
    spec = spec_from_config(lfm2)
    state = spec.layers[0].state
    assert state.kind is StateKind.SHORT_CONV and state.shapes(2) == [((2, 1024), False)]
    p = plan(spec, Layout(), settings())
    geometry = engine_geometry(spec, 1, 1, p.settings, "bfloat16")
    assert geometry.mamba.state_bytes == 2 * 2048 * 2 and geometry.mamba.charge == 2


# Kimi-Linear-48B-A3B's shape: KDA layers with MLA at 1-based layers 4, 8, ..., 24, 27
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 9216, "vocab_size": 163840,
    "max_position_embeddings": 131072, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "torch_dtype": "bfloat16", "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
}
MLA_TOKEN = (512 + 64) * 2  # one MLA layer's latent per token, bf16, on every rank


def kda_state(tp: int, ssm_bytes: int = 4) -> int:
    """conv (4 - 1) rows of q, k, v channels in bf16 and the recurrent state
    (heads, 128, 128) in float32, split across tp (MambaStateShapeCalculator.kda_state_shape)."""
    return 3 * 3 * 32 * 128 // tp * 2 + 32 // tp * 128 * 128 * ssm_bytes


@pytest.mark.parametrize("version", ["0.32", "0.33"])
@pytest.mark.parametrize("tp", [1, 2])
def test_kimi_linear_is_planned_as_vllm_plans_it(version, tp):
    """MLA hybrids align the block size to 128 tokens; 20 KDA layers make 3 groups of 7
    beside the 7 MLA ones, and a request holds 2 state pages in each (no FlashKDA
    checkpoint: the released config's gate is unbounded)."""
    p = plan(spec_from_config(KIMI_LINEAR, "Kimi-Linear"), Layout(tensor_parallel_size=tp),
             settings(version))
    block = 128 * ceil(kda_state(tp) / (128 * MLA_TOKEN))
    assert p.engine.block_size == block == (1920 if tp == 1 else 1024)
    assert p.engine.num_kv_groups == 4
    blocks = 8 * GiB // (7 * block * MLA_TOKEN)
    assert p.engine.num_blocks == blocks
    assert p.engine.max_concurrency == blocks / (ceil(32768 / block) + 3 * 2)


def test_kimi_linear_without_prefix_caching_holds_one_state_page_per_group():
    p = plan(spec_from_config(KIMI_LINEAR, "Kimi-Linear"), Layout(),
             settings(enable_prefix_caching=False))
    block = 128 * ceil(kda_state(1) / (128 * MLA_TOKEN))
    assert p.engine.block_size == block
    assert p.engine.max_concurrency == p.engine.num_blocks / (ceil(32768 / block) + 3)


def test_kda_recurrent_state_dtype_follows_mamba_ssm_cache_dtype():
    """float32 unless --mamba-ssm-cache-dtype bfloat16; vLLM refuses float16."""
    from kvmem.plan.vllm_mamba import state_dtype_bytes

    state = spec_from_config(KIMI_LINEAR).layers[0].state
    assert state.kind is StateKind.KDA
    assert state_dtype_bytes(state, "bfloat16", "auto", "auto", "gpu") == (2, 4)
    assert state_dtype_bytes(state, "bfloat16", "auto", "bfloat16", "gpu") == (2, 2)
    with pytest.raises(ConfigError, match="not --mamba-ssm-cache-dtype float16"):
        state_dtype_bytes(state, "bfloat16", "auto", "float16", "gpu")


def test_a_bounded_kda_gate_adds_flashkdas_checkpoint_block_on_gpus():
    from kvmem.plan.vllm_mamba import checkpoint_blocks
    from kvmem.plan.vllm_release import VllmRelease

    bounded = {**KIMI_LINEAR, "linear_attn_config": {
        **KIMI_LINEAR["linear_attn_config"], "gate_lower_bound": -5.0}}
    for cfg, gpu in ((KIMI_LINEAR, 0), (bounded, 1)):
        state = spec_from_config(cfg).layers[0].state
        assert checkpoint_blocks(state, VllmRelease.parse("0.33"), "gpu") == gpu
        assert checkpoint_blocks(state, VllmRelease.parse("0.32"), "cpu") == 0


def test_kimi_linear_needs_its_kda_fields_and_mla_latent():
    cfg = {**KIMI_LINEAR, "linear_attn_config": {"kda_layers": [1, 2], "num_heads": 32}}
    with pytest.raises(ConfigError, match="needs head_dim, short_conv_kernel_size"):
        spec_from_config(cfg)
    with pytest.raises(ConfigError, match="need kv_lora_rank"):
        spec_from_config({**KIMI_LINEAR, "kv_lora_rank": None})


def test_kvmem_engine_plan_sizes_kda_state_blocks_by_the_mla_latent(tmp_path):
    """``--engine kvmem``: a page of the MLA latent (576 elements a token) holds one KDA
    state at tp 2 (3 x 6144 conv + 16 x 128 x 128 recurrent elements): 496 tokens."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(KIMI_LINEAR))
    run = subprocess.run([sys.executable, "-m", "kvmem", "plan", str(config), "--tp", "2",
                          "--gpu", "H100", "--engine", "kvmem", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    engine = json.loads(run.stdout)["engine"]
    block = 16 * ceil((3 * 3 * 32 * 128 // 2 + 16 * 128 * 128) / (16 * (512 + 64)))
    assert engine["block_size"] == block == 496
    assert (engine["num_kv_groups"], engine["num_state_groups"]) == (4, 3)


# vLLM 0.33's --use-replayssm on Nemotron-H (tp 1, bf16): a ring of 16 per Mamba2 layer,
# x (128 heads, 16, 64) and B (8 groups, 16, 128) in bf16, dt (128, 16) in float32
RING_16 = 128 * 16 * 64 * 2 + 128 * 16 * 4 + 8 * 16 * 128 * 2


def nemotron_h_geometry(**kw):
    s = settings(**kw)
    return engine_geometry(spec_from_config(NEMOTRON_H, "Nemotron-H"), 1, 1, s, "bfloat16")


@pytest.mark.parametrize(("backend", "prefix_caching", "ring"),
                         [("triton", True, 16), ("flashinfer", False, 17)])
def test_replayssm_adds_its_ring_to_each_mamba2_state(backend, prefix_caching, ring):
    """FlashInfer's ring holds one verify window more (1 + 0 speculative tokens)."""
    plain = nemotron_h_geometry(enable_prefix_caching=prefix_caching).mamba
    rings = nemotron_h_geometry(enable_prefix_caching=prefix_caching, replayssm_buffer_len=16,
                                mamba_backend=backend).mamba
    assert rings.state_bytes - plain.state_bytes == RING_16 * ring // 16
    assert rings.charge == plain.charge


def test_replayssm_flags_are_refused_as_vllm_refuses_them(tmp_path):
    def refusal(**kw) -> str:
        with pytest.raises(ConfigError) as err:
            nemotron_h_geometry(**kw)
        return str(err.value)

    assert "ReplaySSM from 0.32, not in 0.31" in refusal(version="0.31",
                                                          replayssm_buffer_len=16)
    assert "at most 16, got 17" in refusal(replayssm_buffer_len=17, mamba_backend="flashinfer",
                                           enable_prefix_caching=False)
    assert "FlashInfer ReplaySSM does not support prefix caching" in refusal(
        replayssm_buffer_len=16, mamba_backend="flashinfer")
    with pytest.raises(ConfigError, match="not supported for architecture "
                                          "'Qwen3NextForCausalLM'"):
        plan(spec_from_config(QWEN3_CODER_NEXT, "q"), Layout(),
             settings(replayssm_buffer_len=16))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(NEMOTRON_H))
    run = subprocess.run([sys.executable, "-m", "kvmem", "plan", str(config),
                          "--use-replayssm", "--kv-cache-memory-bytes", "8GiB",
                          "--engine", "kvmem"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "--use-replayssm is vLLM's (0.32 and later)" in run.stderr


def test_the_vllm_command_keeps_replayssm_and_its_backend():
    from kvmem.plan.flags import engine_command

    p = plan(spec_from_config(NEMOTRON_H, "Nemotron-H"), Layout(),
             settings(replayssm_buffer_len=8, mamba_backend="flashinfer",
                      enable_prefix_caching=False))
    argv = engine_command(p, "vllm", "nvidia/Nemotron-H-8B-Base-8K").argv
    assert argv[argv.index("--use-replayssm") + 1:argv.index("--use-replayssm") + 3] == [
        "--replayssm-buffer-len", "8"]
    assert argv[argv.index("--mamba-backend") + 1] == "flashinfer"
