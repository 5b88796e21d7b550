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
_CACHED = (cpu_features.isa, cpu_features.amx, cpu_features.avx512_bf16,
           cpu_features.onednn_bf16, packed_gemm.backend, packed_gemm.bf16_as_fp32,
           packed_gemm._bf16_kernel)


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


@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_without_onednn_bf16_bf16_weights_run_as_fp32(avx2_only, monkeypatch, gemm):
    """Widened to fp32 (exact) on the fp32 weights' backend, each product rounded once to
    bf16: what a bf16 GEMM with fp32 accumulation gives."""
    if gemm == "mkl" and not packed_gemm.available():
        pytest.skip("this torch build exports no MKL packed GEMM")
    if gemm == "onednn" and not onednn_gemm.available():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setenv("KVMEM_CPU_GEMM", gemm)
    assert not cpu_features.amx() and not cpu_features.onednn_bf16()
    assert "oneDNN bf16 no" in cpu_features.describe()
    weight = torch.randn(96, 80, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert not onednn_gemm.available(torch.bfloat16) and onednn_gemm.pack(weight) is None
    assert packed_gemm.backend(torch.bfloat16) == gemm and packed_gemm.bf16_as_fp32()
    layer = ColumnParallelLinear(80, 96).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.pack_weight()
    kind = packed_gemm.PackedWeight if gemm == "mkl" else onednn_gemm.OneDNNWeight
    assert isinstance(layer.packed, kind) and layer.packed.nbytes == 96 * 80 * 4
    for rows in (1, 20):
        x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, F.linear(x.float(), weight.float()).bfloat16(),
                                   atol=0, rtol=2 ** -8)  # at most one bf16 rounding apart


@pytest.mark.skipif(not (onednn_gemm.available() and packed_gemm.available()),
                    reason="needs both oneDNN's linear and MKL's packed GEMM in torch")
@pytest.mark.parametrize(("intel", "speedup", "picked"), [
    (False, None, "onednn"), (True, 2.0, "onednn"), (True, 1.0, "mkl")])
def test_auto_takes_the_fp32_choice_for_widened_bf16_weights(avx2_only, monkeypatch, intel,
                                                              speedup, picked):
    """On other vendors' CPUs MKL takes its generic path, so oneDNN; on Intel's, the
    fp32 timing decides, once for both dtypes."""
    monkeypatch.setattr(packed_gemm, "_intel_cpu", lambda: intel)
    timed = []
    monkeypatch.setattr(packed_gemm, "_onednn_speedup",
                        lambda dtype: timed.append(dtype) or speedup)
    assert packed_gemm.backend(torch.bfloat16) == packed_gemm.backend(torch.float32) == picked
    assert timed == ([torch.float32] if intel else [])


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
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU is AVX2-only: the default run already ran these test modules "
                    "on the fallbacks")
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
