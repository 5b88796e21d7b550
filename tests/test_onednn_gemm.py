"""oneDNN's GEMM with reordered weights computes what ``F.linear`` computes, and the CPU
projection backend is chosen as documented."""

import pytest
import torch
import torch.nn.functional as F

from kvmem.engine.models import onednn_gemm, packed_gemm
from kvmem.engine.models.layers import ColumnParallelLinear, weight_bytes
from kvmem.engine.models.onednn_gemm import OneDNNWeight
from kvmem.errors import ConfigError

pytestmark = pytest.mark.skipif(not onednn_gemm.available(),
                                reason="this torch build has no oneDNN linear")
needs_bf16 = pytest.mark.skipif(
    not onednn_gemm.available(torch.bfloat16),
    reason="this CPU cannot run oneDNN's bf16 GEMM (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]


@pytest.fixture(autouse=True)
def _fresh_choice():
    packed_gemm.backend.cache_clear()
    yield
    packed_gemm.backend.cache_clear()


def _weight(out_features: int = 96, in_features: int = 80) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_f_linear_with_bias_leading_dims_and_strided_inputs(dtype):
    weight, bias = _weight().to(dtype), torch.randn(96).to(dtype)
    packed = onednn_gemm.pack(weight)
    assert packed.dtype == dtype and packed.nbytes == 96 * 80 * weight.element_size()
    tol = {} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 2e-2}
    for x in (torch.randn(1, 80), torch.randn(3, 5, 80), torch.randn(6, 200)[:, 10:90],
              torch.randn(80, 6).t()):
        x = x.to(dtype)
        got = onednn_gemm.linear(x, packed, bias)
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], 96)
        want = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(got.float(), want, **tol)
    assert onednn_gemm.linear(torch.empty(0, 80, dtype=dtype), packed).shape == (0, 96)
    strided = torch.randn(6, 200)[:, 10:90].to(dtype)  # read in place, not copied
    assert torch.equal(onednn_gemm.linear(strided, packed),
                       onednn_gemm.linear(strided.contiguous(), packed))


@needs_bf16
def test_inputs_of_another_dtype_are_converted_and_converted_back():
    weight = _weight()
    x = torch.randn(3, 2, 80, generator=torch.Generator().manual_seed(2))
    got = onednn_gemm.linear(x, onednn_gemm.pack(weight.bfloat16()))
    assert got.dtype == torch.float32 and got.shape == (3, 2, 96)
    want = F.linear(x.bfloat16().float(), weight.bfloat16().float())  # rounded inputs
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features", [576, 1536])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(dtype, in_features):
    """From two rows up, as the served engine needs: a request's tokens are the same
    whichever requests share its steps."""
    packed = onednn_gemm.pack(_weight(576, in_features).to(dtype))
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = onednn_gemm.linear(x[:2], packed)
    for rows in (3, 8, 17, 64, 300):
        assert torch.equal(onednn_gemm.linear(x[:rows], packed)[:2], alone)


def test_bad_inputs():
    packed = onednn_gemm.pack(_weight())
    with pytest.raises(ValueError, match="80"):
        onednn_gemm.linear(torch.randn(2, 81), packed)
    with pytest.raises(TypeError, match="floating-point"):
        onednn_gemm.linear(torch.ones(2, 80, dtype=torch.int64), packed)
    assert onednn_gemm.pack(_weight().half()) is None
    assert onednn_gemm.pack(torch.randn(4)) is None


@pytest.mark.parametrize(("setting", "kind"), [("onednn", OneDNNWeight),
                                               ("mkl", packed_gemm.PackedWeight)])
def test_the_environment_picks_the_backend(monkeypatch, setting, kind):
    if setting == "mkl" and not packed_gemm.available():
        pytest.skip("no MKL packed GEMM in this torch build")
    monkeypatch.setenv("KVMEM_CPU_GEMM", setting)
    assert packed_gemm.backend(torch.float32) == setting
    assert isinstance(packed_gemm.pack(_weight()), kind)


def test_a_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVMEM_CPU_GEMM", "fastest")
    with pytest.raises(ConfigError, match="auto, mkl or onednn"):
        packed_gemm.backend(torch.float32)


@pytest.mark.skipif(not packed_gemm.available(), reason="no MKL packed GEMM to compare")
@pytest.mark.parametrize(("speedup", "picked"), [(2.0, "onednn"), (1.1, "mkl")])
def test_auto_picks_onednn_only_when_clearly_faster(monkeypatch, speedup, picked):
    """On Intel's CPUs the choice is timed."""
    monkeypatch.delenv("KVMEM_CPU_GEMM", raising=False)
    monkeypatch.setattr(packed_gemm, "_intel_cpu", lambda: True)
    monkeypatch.setattr(packed_gemm, "_onednn_speedup", lambda dtype: speedup)
    assert packed_gemm.backend(torch.float32) == picked


@pytest.mark.skipif(not packed_gemm.available(), reason="no MKL packed GEMM to compare")
def test_other_vendors_cpus_take_onednn_without_timing(monkeypatch):
    """MKL's generic path elsewhere: no timing that could flip between processes."""
    monkeypatch.delenv("KVMEM_CPU_GEMM", raising=False)
    monkeypatch.setattr(packed_gemm, "_intel_cpu", lambda: False)

    def timed(dtype):
        raise AssertionError("timed")

    monkeypatch.setattr(packed_gemm, "_onednn_speedup", timed)
    assert packed_gemm.backend(torch.float32) == "onednn"
    monkeypatch.setenv("KVMEM_CPU_GEMM", "mkl")
    packed_gemm.backend.cache_clear()
    assert packed_gemm.backend(torch.float32) == "mkl"


@pytest.mark.parametrize(("vendors", "intel"), [
    (["GenuineIntel", "GenuineIntel"], True), (["AuthenticAMD"] * 2, False),
    (["HygonGenuine"], False), (None, True)])
def test_the_cpu_vendor_is_read_from_cpuinfo(tmp_path, vendors, intel):
    info = tmp_path / "cpuinfo"
    if vendors is not None:  # None: no cpuinfo at all
        info.write_text("".join(f"processor\t: {i}\nvendor_id\t: {v}\nflags\t\t: fpu\n\n"
                                for i, v in enumerate(vendors)))
    assert packed_gemm._intel_cpu(info) is intel


@pytest.mark.skipif(not packed_gemm.available(), reason="no MKL packed GEMM to compare")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_timing_compares_the_two_backends_on_real_calls(dtype, monkeypatch):
    monkeypatch.setattr(packed_gemm, "bf16_as_fp32", lambda: True)  # MKL takes bf16 (as fp32)
    speedup = packed_gemm._onednn_speedup(dtype)
    assert 0.05 < speedup < 50  # both ran the probe; the figure is a ratio of times


@needs_bf16
def test_a_bf16_layer_keeps_two_bytes_a_weight_on_onednn(monkeypatch):
    monkeypatch.setenv("KVMEM_CPU_GEMM", "onednn")
    layer = ColumnParallelLinear(80, 96).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(_weight())
    x = torch.randn(4, 80).bfloat16()
    want = F.linear(x.float(), layer.weight.float())
    layer.pack_weight()
    assert isinstance(layer.packed, OneDNNWeight) and layer.weight.numel() == 0
    assert weight_bytes(layer) == 96 * 80 * 2
    torch.testing.assert_close(layer(x).float(), want, rtol=2 ** -7, atol=2e-2)
