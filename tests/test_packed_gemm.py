"""fp32 projections on MKL's packed GEMM compute what ``F.linear`` computes."""

import threading

import pytest
import torch
import torch.nn.functional as F

from kvmem.engine import cpu_features
from kvmem.engine.models import onednn_gemm, packed_gemm
from kvmem.engine.models.layers import PackableLinear, weight_bytes

pytestmark = pytest.mark.skipif(not packed_gemm.available(),
                                reason="this torch build exports no MKL packed GEMM")


@pytest.fixture(autouse=True)
def _mkl_backend(monkeypatch):
    """These tests are about MKL's packed GEMM, whichever backend this CPU would pick."""
    monkeypatch.setattr(packed_gemm, "backend", lambda dtype: "mkl")


def _weight(out_features: int = 96, in_features: int = 80) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rows", [2, 7, 33, 300])
def test_equals_f_linear_on_a_column_major_weight_bit_for_bit(rows):
    weight = _weight()
    x = torch.randn(rows, weight.shape[1])
    column_major = weight.t().contiguous().t()
    assert torch.equal(packed_gemm.linear(x, packed_gemm.pack(weight)), F.linear(x, column_major))


def test_one_row_bias_leading_dims_and_strided_inputs():
    weight, bias = _weight(), torch.randn(96)
    packed = packed_gemm.pack(weight)
    one = torch.randn(1, 80)
    torch.testing.assert_close(packed_gemm.linear(one, packed), F.linear(one, weight))
    torch.testing.assert_close(packed_gemm.linear(one, packed, bias), F.linear(one, weight, bias))
    batched = torch.randn(3, 5, 80)
    torch.testing.assert_close(packed_gemm.linear(batched, packed, bias),
                               F.linear(batched, weight, bias))
    strided = torch.randn(6, 200)[:, 10:90]  # rows of a wider tensor
    torch.testing.assert_close(packed_gemm.linear(strided, packed), F.linear(strided, weight))
    transposed = torch.randn(80, 6).t()
    torch.testing.assert_close(packed_gemm.linear(transposed, packed),
                               F.linear(transposed, weight))
    assert packed_gemm.linear(torch.empty(0, 80), packed).shape == (0, 96)


@pytest.mark.parametrize("layout", ["column-major", "strided"])
def test_any_weight_layout_packs_to_the_same_product(layout):
    weight = _weight()
    stored = weight.t().contiguous().t() if layout == "column-major" \
        else torch.zeros(96, 160)[:, ::2].copy_(weight)
    x = torch.randn(9, 80)
    torch.testing.assert_close(packed_gemm.linear(x, packed_gemm.pack(stored)), x @ weight.t())


def test_bf16_weights_pack_as_fp32_unless_kept_in_bf16(monkeypatch):
    weight = _weight().bfloat16()
    x = torch.randn(packed_gemm.SMALL_BF16_ROWS + 1, 80).bfloat16()  # past the bf16 kernel
    monkeypatch.setattr(packed_gemm, "bf16_as_fp32", lambda: True)
    packed = packed_gemm.pack(weight)
    y = packed_gemm.linear(x, packed)
    assert y.dtype == torch.bfloat16
    # the bf16 product rounded once from fp32: what a bf16 GEMM with fp32 accumulation gives
    assert torch.equal(y, F.linear(x.float(), weight.float().t().contiguous().t()).bfloat16())
    monkeypatch.setattr(packed_gemm, "bf16_as_fp32", lambda: False)
    assert packed_gemm.pack_mkl(weight) is None


needs_bf16_kernel = pytest.mark.skipif(not packed_gemm.bf16_kernel_available(),
                                       reason="no AVX-512 BF16 on this CPU")


@needs_bf16_kernel
@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 80, 96), (8, 576, 960), (9, 70, 33), (16, 1536, 575)])
def test_small_bf16_batches_run_on_the_bf16_copy(monkeypatch, rows, in_features,
                                                 out_features):
    """Decode-sized batches: exact bf16 products summed in fp32, any K (a masked tail),
    any N (an odd last row), rows in passes of eight."""
    monkeypatch.setattr(packed_gemm, "bf16_as_fp32", lambda: True)
    weight = _weight(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    packed = packed_gemm.pack(weight)
    assert packed.bf16 is not None and packed.nbytes == out_features * in_features * 6
    x = torch.randn(2, 20, in_features).bfloat16()[:, :rows]  # rows of a longer batch
    exact = x.double() @ weight.double().t()
    got = packed_gemm._small_bf16(x.reshape(-1, in_features).contiguous(), packed.bf16)
    torch.testing.assert_close(got.double(), exact.reshape(-1, out_features), rtol=1e-5,
                               atol=1e-4)
    calls = []
    small = packed_gemm._small_bf16
    monkeypatch.setattr(packed_gemm, "_small_bf16", lambda *a: calls.append(1) or small(*a))
    y = packed_gemm.linear(x, packed, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, rows, out_features)
    assert len(calls) == (2 * rows <= packed_gemm.SMALL_BF16_ROWS)
    # within one bf16 rounding of the fp32 path (the sums run in another order)
    torch.testing.assert_close(y.float(), (exact + bias.double()).float(), rtol=2 ** -7,
                               atol=1e-2)


@pytest.mark.parametrize(("onednn_bf16", "amx", "setting", "as_fp32"), [
    (True, True, None, False), (True, False, None, True), (True, False, "bf16", False),
    (False, True, None, True), (False, False, "bf16", True)])
def test_the_bf16_choice_follows_the_cpu_and_the_environment(monkeypatch, onednn_bf16, amx,
                                                             setting, as_fp32):
    """bf16 weights stay bf16 (on oneDNN) with AMX or when asked, but only where oneDNN
    runs bf16 GEMMs at all; elsewhere (AVX2-only CPUs) they run as fp32 on MKL."""
    monkeypatch.setattr(cpu_features, "amx", lambda: amx)
    monkeypatch.setattr(onednn_gemm, "available", lambda dtype=torch.float32: onednn_bf16)
    if setting is None:
        monkeypatch.delenv("KVMEM_CPU_BF16_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("KVMEM_CPU_BF16_WEIGHTS", setting)
    packed_gemm.bf16_as_fp32.cache_clear()
    try:
        assert packed_gemm.bf16_as_fp32() is as_fp32
    finally:
        packed_gemm.bf16_as_fp32.cache_clear()


def test_what_does_not_pack_and_bad_inputs():
    assert packed_gemm.pack(_weight().half()) is None
    assert packed_gemm.pack(torch.randn(4)) is None
    packed = packed_gemm.pack(_weight())
    with pytest.raises(TypeError, match="fp32 or bf16 CPU inputs"):
        packed_gemm.linear(torch.randn(2, 80, dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="80"):
        packed_gemm.linear(torch.randn(2, 81), packed)


def test_another_thread_uses_torchs_thread_count():
    """MKL starts every new thread with all cores; the serving engine steps on its own thread."""
    packed, x = packed_gemm.pack(_weight()), torch.randn(4, 80)
    seen = []

    def step():
        packed_gemm.linear(x, packed)
        seen.append(packed_gemm._load().mkl_get_max_threads())

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert seen == [torch.get_num_threads()]


def _load_tiny(tmp_path):
    from test_models import load
    from tiny_models import make_tiny_checkpoint

    return load(make_tiny_checkpoint(tmp_path, "llama"))


def test_a_loaded_model_keeps_only_packed_weights_and_computes_the_same(tmp_path, monkeypatch):
    from test_models import PagedRun

    files, model = _load_tiny(tmp_path)
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert model.lm_head in linears and len(linears) > 3
    for module in linears:
        assert module.packed is not None and module.weight.numel() == 0
    prompts = [[1, 5, 9, 14, 3], [7, 2, 11]]
    packed_tokens, packed_logits = PagedRun(model, files.config).generate(prompts, 6)

    monkeypatch.setattr(packed_gemm, "pack", lambda weight: None)
    _, unpacked = _load_tiny(tmp_path)
    for module in (m for m in unpacked.modules() if isinstance(m, PackableLinear)):
        assert module.packed is None  # the fallback: the same weight, column-major
        assert module.weight.t().is_contiguous() and not module.weight.is_contiguous()
    assert weight_bytes(model) == weight_bytes(unpacked)
    tokens, logits = PagedRun(unpacked, files.config).generate(prompts, 6)
    assert packed_tokens == tokens
    for a, b in zip(packed_logits, logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_cpu_kernels_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv("KVMEM_CPU_KERNELS", "0")
    packed_gemm._load.cache_clear()
    try:
        assert not packed_gemm.available() and packed_gemm.pack(_weight()) is None
    finally:
        monkeypatch.delenv("KVMEM_CPU_KERNELS")
        packed_gemm._load.cache_clear()
    assert packed_gemm.available()
