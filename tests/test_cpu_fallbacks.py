"""kvmem on an AVX2-only CPU, forced on any x86-64 CPU with ``KVMEM_CPU_ISA=avx2``.

On such a CPU (AMD's Zen 3, say) oneDNN cannot run bf16 GEMMs, the C kernels are built
without AVX-512 (the prefill kernel and the bf16 decode GEMM decline, and SDPA and MKL take
their work), and torch dispatches to its AVX2 kernels. Here every CPU-specific choice is
forced to that fallback: the GEMM choice in this process, and the CPU kernels' and models'
own test modules, and the engine's bf16 and fp32 answers, in a process of their own
(``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``), where the library is built
for x86-64-v3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvmem.engine import cpu_features
from kvmem.engine.attention import cpu_kernels
from kvmem.engine.models import onednn_gemm, packed_gemm
from kvmem.engine.models.layers import ColumnParallelLinear
from kvmem.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
AVX2_ENV = {"KVMEM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}
_CACHED = (cpu_features.isa, cpu_features.amx, cpu_features.onednn_bf16,
           packed_gemm.backend, packed_gemm.bf16_as_fp32)


def _clear() -> None:
    for fn in _CACHED:
        fn.cache_clear()


@pytest.fixture
def avx2_only(monkeypatch):
    """kvmem's choices in this process as on an AVX2-only CPU."""
    monkeypatch.setenv("KVMEM_CPU_ISA", "avx2")
    monkeypatch.delenv("KVMEM_CPU_GEMM", raising=False)
    monkeypatch.delenv("KVMEM_CPU_BF16_WEIGHTS", raising=False)
    _clear()
    yield
    monkeypatch.undo()
    _clear()


def test_the_setting_is_checked_and_names_the_compiler_target(monkeypatch):
    for value, march in (("native", "native"), ("AVX2", "x86-64-v3"), ("", "native")):
        monkeypatch.setenv("KVMEM_CPU_ISA", value)
        _clear()
        assert cpu_features.march() == march
    monkeypatch.setenv("KVMEM_CPU_ISA", "avx512")
    _clear()
    with pytest.raises(ConfigError, match="KVMEM_CPU_ISA must be one of native, avx2"):
        cpu_features.march()
    monkeypatch.undo()
    _clear()


def test_without_onednn_bf16_bf16_weights_run_on_mkls_fp32_gemm(avx2_only):
    assert not cpu_features.amx() and not cpu_features.onednn_bf16()
    assert "oneDNN bf16 no" in cpu_features.describe()
    weight = torch.randn(96, 80, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert not onednn_gemm.available(torch.bfloat16) and onednn_gemm.pack(weight) is None
    assert packed_gemm.backend(torch.bfloat16) == "mkl" and packed_gemm.bf16_as_fp32()
    if onednn_gemm.available():
        assert isinstance(onednn_gemm.pack(weight.float()), onednn_gemm.OneDNNWeight)
    if not packed_gemm.available():
        pytest.skip("this torch build exports no MKL packed GEMM")
    layer = ColumnParallelLinear(80, 96).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    x = torch.randn(20, 80, generator=torch.Generator().manual_seed(1)).bfloat16()
    layer.pack_weight()
    assert isinstance(layer.packed, packed_gemm.PackedWeight)
    # fp32 products of the bf16 values, rounded once to bf16
    assert torch.equal(layer(x), F.linear(x.float(), weight.float()).bfloat16())


@pytest.mark.parametrize("settings", [{"KVMEM_CPU_GEMM": "onednn"},
                                      {"KVMEM_CPU_BF16_WEIGHTS": "bf16"}])
def test_asking_for_onednn_bf16_falls_back_where_the_cpu_cannot(avx2_only, monkeypatch,
                                                                settings, caplog):
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert packed_gemm.backend(torch.bfloat16) == "mkl"
    assert packed_gemm.bf16_as_fp32()
    if "KVMEM_CPU_GEMM" in settings:
        assert "cannot run oneDNN's bfloat16 GEMM" in caplog.text


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for the CPU kernels")
def test_the_cpu_kernel_and_model_tests_pass_on_the_avx2_fallbacks(tmp_path):
    """The same test modules, in a process where every fast path is the AVX2 one."""
    script = (
        "from kvmem.engine.attention import cpu_kernels as k\n"
        "print('needs build', k.needs_build())\n"
        "lib = k.library()\n"
        "print('needs build', k.needs_build())\n"
        "print('prefill kernel', lib.kvmem_prefill_supported(64, 3))\n")
    env = {**os.environ, **AVX2_ENV, "KVMEM_CACHE_DIR": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "needs build True\nneeds build False\nprefill kernel 0" in probe.stdout  # SDPA prefills
    assert [p.name for p in (tmp_path / "kernels").iterdir()]  # its own library
    modules = ["tests/test_cpu_fused_ops.py", "tests/test_attention_cpu_kernel.py",
               "tests/test_attention.py", "tests/test_onednn_gemm.py",
               "tests/test_packed_gemm.py", "tests/test_models.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "-k", "not triton", *modules],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in run.stdout
    # what needs the CPU's bf16 instructions says so, and nothing else is skipped
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("bf16" in line or "BF16" in line or "AVX-512" in line
                           for line in skipped), skipped
