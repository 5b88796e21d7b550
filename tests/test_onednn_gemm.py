"""oneDNN's GEMM with reordered weights computes what ``F.linear`` computes, and the CPU
projection backend is chosen as documented."""

import pytest
import torch
import torch.nn.functional as F

from kvmem.engine.models import onednn_gemm, packed_gemm
from kvmem.engine.models.layers import ColumnParallelLinear, GateUpParallelLinear, weight_bytes
from kvmem.engine.models.onednn_gemm import OneDNNWeight
from kvmem.errors import ConfigError

pytestmark = pytest.mark.skipif(not onednn_gemm.available(),
                                reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def _fresh_choice():
    packed_gemm.backend.cache_clear()
    yield
    packed_gemm.backend.cache_clear()


def _weight(out_features: int = 96, in_features: int = 80) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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
    monkeypatch.delenv("KVMEM_CPU_GEMM", raising=False)
    monkeypatch.setattr(packed_gemm, "_onednn_speedup", lambda dtype: speedup)
    assert packed_gemm.backend(torch.float32) == picked


@pytest.mark.skipif(not packed_gemm.available(), reason="no MKL packed GEMM to compare")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_timing_compares_the_two_backends_on_real_calls(dtype):
    speedup = packed_gemm._onednn_speedup(dtype)
    assert 0.05 < speedup < 50  # both ran the probe; the figure is a ratio of times


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_gate_mul_is_the_gated_activation(dtype):
    gate, up = _weight(96, 80).to(dtype), (_weight(96, 80) * 0.5 + 0.1).to(dtype)
    bg, bu = torch.randn(96).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(3, 5, 80).to(dtype)
    got = onednn_gemm.silu_gate_mul(x, onednn_gemm.pack(gate), onednn_gemm.pack(up), bg, bu)
    assert got.dtype == dtype and got.shape == (3, 5, 96) and got.is_contiguous()
    want = F.silu(F.linear(x.float(), gate.float(), bg.float())) \
        * F.linear(x.float(), up.float(), bu.float())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 \
        else {"rtol": 2 ** -6, "atol": 5e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    empty = onednn_gemm.silu_gate_mul(torch.empty(0, 80, dtype=dtype), onednn_gemm.pack(gate),
                                      onednn_gemm.pack(up))
    assert empty.shape == (0, 96)
    with pytest.raises(ValueError, match="differ"):
        onednn_gemm.silu_gate_mul(x, onednn_gemm.pack(gate), onednn_gemm.pack(_weight(48, 80)))


@pytest.mark.parametrize("setting", ["onednn", "mkl"])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_layer_gives_the_same_mlp_activation_on_either_backend(monkeypatch, setting,
                                                                       bias):
    if setting == "mkl" and not packed_gemm.available():
        pytest.skip("no MKL packed GEMM in this torch build")
    monkeypatch.setenv("KVMEM_CPU_GEMM", setting)
    layer = GateUpParallelLinear(80, 48, bias=bias)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 80, generator=gen) * 0.2)
        if bias:
            layer.bias.copy_(torch.randn(96, generator=gen))
    x = torch.randn(7, 80, generator=gen)
    plain = F.linear(x, layer.weight.clone(), None if layer.bias is None else layer.bias.clone())
    gate, up = plain.chunk(2, dim=-1)
    layer.pack_weight()
    assert layer.weight.numel() == 0
    assert (layer.halves is not None) == (setting == "onednn")
    assert weight_bytes(layer) == 96 * 80 * 4 + (96 * 4 if bias else 0)
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
