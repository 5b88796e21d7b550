"""vLLM's CUDA attention backends in kvmem's plan: their kernel block sizes and the order
vLLM tries them in (against vLLM 0.32's and 0.33's own code), and the block sizes, notes
and refusals of ``kvmem plan`` on GPUs that follow from them.

The vLLM part runs ``tests/vllm_backend_rules.py`` once per venv: it imports each backend
kvmem knows and asks its sizes (or reads them from the source where the CPU build cannot
import the module), asks vLLM's platform the block size for sets of backends, and asks
``_get_backend_priorities`` its order for each GPU generation and model kind.
"""

from __future__ import annotations

import json
from itertools import product

import pytest
import vllm_cpu

from kvmem.cli import main
from kvmem.errors import ConfigError
from kvmem.plan import EngineSettings, Layout, plan
from kvmem.plan.vllm_backends import (
    BACKENDS,
    INDEXER,
    AttentionBackends,
    _priorities,
    select,
)
from kvmem.plan.vllm_release import VllmRelease
from kvmem.spec.catalog import named_spec as catalog_spec

SETS = [["FLASHMLA"], ["TRITON_MLA"], ["FLASH_ATTN"], ["TOKENSPEED_MLA"],
        ["FLASHMLA_SPARSE", INDEXER.name], ["FLASHINFER_MLA_SPARSE", INDEXER.name],
        ["FLASH_ATTN_MLA_SPARSE", INDEXER.name], ["FLASHINFER_MLA_SPARSE_SM90", INDEXER.name]]
ORDERS = [{"mla": mla, "major": major, "quantized_kv": q, "heads": heads, "head_size": 576}
          for mla, major, q, heads in product((False, True), (8, 9, 10, 12), (False, True),
                                              (16, 128))]
# backends vLLM tries that kvmem leaves out: TurboQuant runs only its own KV dtypes
NOT_PLANNED = {"TURBOQUANT"}


@pytest.fixture(scope="module", params=("0.32", "0.33"))
def vllm_backends(request) -> tuple[str, dict]:
    script = (vllm_cpu.REPO / "tests" / "vllm_backend_rules.py").read_text()
    names = [*BACKENDS, INDEXER.name]
    return request.param, vllm_cpu.run_for_json(
        script, "KVMEM_BACKENDS", str(vllm_cpu.REPO / "tests"), json.dumps(names),
        json.dumps(SETS), json.dumps(ORDERS), series=request.param, timeout=300)


@pytest.mark.vllm
def test_kernel_block_sizes_are_vllms(vllm_backends):
    series, got = vllm_backends
    release = VllmRelease.parse(series)
    read = {"imported": 0, "source": 0}
    for backend in [*BACKENDS.values(), INDEXER]:
        theirs = got["backends"][backend.name]
        assert "traceback" not in theirs, theirs["traceback"]
        if not release.since(*backend.since):
            assert theirs.get("missing"), f"{backend.name} is in vLLM {series}"
            continue
        assert tuple(theirs["sizes"]) == backend.sizes, backend.name
        read[theirs["read"]] += 1
    assert read["imported"] >= 10 and read["source"] >= 3, read  # both ways are exercised


@pytest.mark.vllm
def test_block_size_without_block_size_flag_is_vllms(vllm_backends):
    _, got = vllm_backends
    for case in got["preferred"]:
        assert "traceback" not in case, case["traceback"]
        ours = AttentionBackends(tuple(BACKENDS.get(n, INDEXER) for n in case["backends"]),
                                 chosen=False)
        assert ours.preferred_block_size() == case["block_size"], case["backends"]


@pytest.mark.vllm
def test_backend_order_is_vllms(vllm_backends):
    series, got = vllm_backends
    release = VllmRelease.parse(series)
    for case, theirs in zip(ORDERS, got["priorities"], strict=True):
        theirs = [n for n in theirs if n not in NOT_PLANNED and n != "TRITON_FLASHINFER"]
        ours = [n for sparse in (False, True) if case["mla"] or not sparse
                for n in _priorities(case["mla"], sparse, case["major"], case["quantized_kv"],
                                     case["heads"])
                if release.since(*BACKENDS[n].since)]
        assert ours == theirs, case


# -- kvmem plan on GPUs ---------------------------------------------------------------------

def _plan(model: str, gpu: str | None = None, tp: int = 8, **settings):
    spec = catalog_spec(model)
    return plan(spec, Layout(tensor_parallel_size=tp, gpus=[gpu] if gpu else None,
                             gpu_memory_bytes=None if gpu else 80 << 30),
                EngineSettings(max_model_len=32768, vllm_version="0.33",
                               backend_block_size=True, **settings), suggest=False)


@pytest.mark.parametrize(("gpu", "arch", "kv_dtype", "block", "backend"), [
    ("H200", 9, "auto", 16, "FLASH_ATTN_MLA"),
    ("H200", 9, "fp8", 64, "FLASHMLA"),  # FlashAttention's MLA takes no fp8 KV cache
    ("B200", 10, "auto", 32, "FLASHINFER_MLA"),
    ("A100-80GB", 8, "auto", 16, "TRITON_MLA"),
])
def test_mla_block_size_follows_the_gpus_backend(gpu, arch, kv_dtype, block, backend):
    p = _plan("deepseek-ai/DeepSeek-V3", gpu, gpu_arch=arch, kv_cache_dtype=kv_dtype)
    assert p.engine.block_size == block
    if block != 16:
        assert any(backend in n and f"blocks of {block}" in n for n in p.notes), p.notes


def test_blocks_of_a_larger_kernel_hold_the_same_tokens():
    small = _plan("deepseek-ai/DeepSeek-V3", "B200", gpu_arch=10,
                  attention_backend="TRITON_MLA")
    large = _plan("deepseek-ai/DeepSeek-V3", "B200", gpu_arch=10,
                  attention_backend="CUTLASS_MLA")
    assert (small.engine.block_size, large.engine.block_size) == (16, 128)
    assert large.engine.num_blocks == small.engine.num_blocks // 8
    assert small.engine.kv_cache_size_tokens - large.engine.kv_cache_size_tokens < 128


def test_sparse_mla_takes_the_indexers_blocks_on_every_gpu():
    for gpu, arch in (("H100", 9), ("B200", 10)):
        assert _plan("deepseek-ai/DeepSeek-V3.2", gpu, gpu_arch=arch).engine.block_size == 64


def test_a_given_block_size_picks_a_backend_that_takes_it():
    spec = catalog_spec("deepseek-ai/DeepSeek-V3")
    b200 = VllmRelease.parse("0.33")
    assert select(spec, b200, major=10, tp=8, quantized_kv=False,
                  block_size=16).names == "TRITON_MLA"
    assert select(spec, b200, major=10, tp=8, quantized_kv=False,
                  block_size=64).names == "FLASHINFER_MLA"


def test_flashattention_on_blackwell_takes_pages_of_128_for_heads_of_256():
    # Gemma 3 4B has heads of 256 and no logit soft-capping
    gemma = {"model": "google/gemma-3-4b-it", "gpu": "B200", "tp": 1, "gpu_arch": 10}
    p = _plan(**gemma, attention_backend="FLASH_ATTN")
    assert p.engine.block_size == 128
    assert _plan(**gemma).engine.block_size == 16  # FlashInfer comes first on Blackwell
    # FA4's head-256 kernel falls back to FA2 with a quantized KV cache
    fp8 = _plan(**gemma, attention_backend="FLASH_ATTN", kv_cache_dtype="fp8")
    assert fp8.engine.block_size == 16


def test_a_hybrids_raise_aligns_to_the_backends_kernel():
    # Qwen3-Next: heads of 256; FA4's pages of 128 on Blackwell align the raise
    default = _plan("Qwen/Qwen3-Next-80B-A3B-Instruct", "B200", gpu_arch=10)
    fa4 = _plan("Qwen/Qwen3-Next-80B-A3B-Instruct", "B200", gpu_arch=10,
                attention_backend="FLASH_ATTN")
    assert default.engine.block_size % 64 == 0 and fa4.engine.block_size % 128 == 0
    assert fa4.engine.block_size >= default.engine.block_size


@pytest.mark.parametrize(("argv", "words"), [
    (["--attention-backend", "FLASHMLA", "--block-size", "16", "--gpu", "B200"],
     "does not take --block-size 16"),
    (["--attention-backend", "NOPE"], "not one of vLLM 0.33's CUDA attention backends"),
    (["--attention-backend", "FLASH_ATTN"], "need an MLA backend"),
    (["--attention-backend", "CUTLASS_MLA", "--gpu", "H100"],
     "does not run it on a GPU of compute capability 9.x"),
    (["--attention-backend", "FLASH_ATTN_MLA", "--kv-cache-dtype", "fp8"],
     "does not run it with an fp8 KV cache"),
    (["--attention-backend", "FLASHMLA", "--device", "cpu", "--kv-cache-memory-bytes", "8GiB"],
     "--attention-backend is vLLM's on a GPU"),
])
def test_bad_backends_are_refused_in_one_line(argv, words, capsys):
    assert main(["plan", "deepseek-ai/DeepSeek-V3", "--tp", "8", "--max-model-len", "32768",
                 *(["--gpu-memory", "80"] if "--gpu" not in argv else []), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_the_named_backend_and_its_blocks_come_out_of_the_plan(capsys):
    assert main(["plan", "deepseek-ai/DeepSeek-V3", "--tp", "8", "--gpu", "B200",
                 "--max-model-len", "32768", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"]["block_size"] == 32
    assert any("FLASHINFER_MLA" in n for n in out["notes"])


def test_a_log_that_sets_the_block_size_for_a_backend_is_planned_with_it(tmp_path, capsys):
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO 12-01 10:00:00 [api_server.py:100] vLLM API server version 0.33.0\n"
        "INFO 12-01 10:00:01 [utils.py:200] non-default args: {'model': "
        "'deepseek-ai/DeepSeek-V3', 'tensor_parallel_size': 8, 'max_model_len': 32768}\n"
        "INFO 12-01 10:00:40 [interface.py:777] Setting kv cache block size to 32 for "
        "FLASHINFER_MLA backend(s).\n"
        "INFO 12-01 10:02:00 [kv_cache_utils.py:1000] GPU KV cache size: 1,173,952 tokens\n")
    assert main(["plan", "--from-vllm-log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "block size 32: vLLM set it for its FLASHINFER_MLA backend(s)" in out
    assert "1,173,952 tokens  1,173,952 tokens  match" in out


def test_unknown_gpu_mla_plans_note_the_hopper_assumption():
    p = plan(catalog_spec("deepseek-ai/DeepSeek-V3"), Layout(tensor_parallel_size=8),
             EngineSettings(kv_cache_memory_bytes=10 << 30, max_model_len=32768,
                            vllm_version="0.33", backend_block_size=True), suggest=False)
    assert p.engine.block_size == 16
    assert any("give --gpu" in n for n in p.notes), p.notes


def test_a_backend_is_refused_where_vllm_runs_none():
    with pytest.raises(ConfigError, match="no attention backend"):
        _plan("deepseek-ai/DeepSeek-V3.2", "A100-80GB", gpu_arch=8)


def test_a_block_size_vllm_runs_elsewhere_is_kept_where_the_gpu_is_not_known():
    # the plugin and logs give the running engine's block size and no GPU: sparse MLA
    # with blocks of 16 runs on no NVIDIA backend, so none is assumed
    spec = catalog_spec("deepseek-ai/DeepSeek-V3.2")
    assert select(spec, VllmRelease.parse("0.33"), major=None, tp=8, quantized_kv=False,
                  block_size=16).backends == ()
    p = plan(spec, Layout(tensor_parallel_size=8),
             EngineSettings(kv_cache_memory_bytes=10 << 30, max_model_len=32768,
                            vllm_version="0.33", block_size=16), suggest=False)
    assert p.engine.block_size == 16
