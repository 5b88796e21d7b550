"""The fused CPU layer steps (fused_ops.c, activation.c) agree with the eager torch ops
they replace, in fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from kvmem.engine.attention import cpu_kernels
from kvmem.engine.models import cpu_ops
from kvmem.engine.models.layers import RMSNorm
from kvmem.engine.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="no C compiler for the CPU kernels")


def _eager_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * y


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_eager(rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, residual = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    total, normed = norm.add_and_norm(x, residual)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, _eager_norm(norm, x + residual), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(norm(x), _eager_norm(norm, x), atol=1e-6, rtol=1e-6)
    strided = torch.randn(rows, 200, generator=gen)[:, :96]  # rows of a wider tensor
    torch.testing.assert_close(norm(strided), _eager_norm(norm, strided), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (2, 1, 32)])
def test_rotary_is_bitwise_the_eager_rotation(heads, kv_heads, head_dim):
    rows = 37
    gen = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "max_position_embeddings": 512})
    cos, sin = rotary.cos_sin(torch.randint(0, 512, (rows,), generator=gen))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, :heads * head_dim].reshape(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    expected_q, expected_k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert cpu_ops.rotary_qk_(qkv, heads + kv_heads, head_dim, cos, sin)
    assert torch.equal(qkv[:, :heads * head_dim], expected_q.reshape(rows, -1))
    assert torch.equal(qkv[:, heads * head_dim:(heads + kv_heads) * head_dim],
                       expected_k.reshape(rows, -1))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v)  # values untouched


def _no_kernels(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_kernel", lambda *args: None)


def test_bf16_norm_rounds_as_the_eager_ops(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)  # as a bf16 model holds it
    norm.weight.data = torch.randn(576, generator=gen).bfloat16()
    x, residual = (torch.randn(300, 576, generator=gen).bfloat16() for _ in range(2))
    total, normed = norm.add_and_norm(x, residual)
    alone = norm(x)
    _no_kernels(monkeypatch)
    eager_total, eager_normed = norm.add_and_norm(x, residual)
    assert total.dtype == normed.dtype == torch.bfloat16
    assert torch.equal(total, eager_total)
    # the sum of squares is summed in another order: a rare last-bit difference may remain
    assert (normed != eager_normed).float().mean() < 1e-3
    torch.testing.assert_close(normed, eager_normed, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(alone, norm(x), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_eager(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(33, 2 * 200, generator=gen) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0], dtype=dtype)  # exp over/underflows
    wide = torch.randn(33, 500, generator=gen).to(dtype)[:, :400]  # rows of a wider tensor
    wide.copy_(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    fused, from_wide = cpu_ops.silu_mul(gate_up), cpu_ops.silu_mul(wide)
    assert fused.shape == (33, 200) and fused.is_contiguous() and fused.dtype == dtype
    assert torch.equal(fused, from_wide)
    assert fused[0, 0] == 0 and fused[0, 1] == 200 * up[0, 1] and fused[0, 2] == 0
    if dtype == torch.float32:
        torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)
    else:  # silu rounds to bf16 before the product, as the eager ops; their exp differs
        assert (fused != expected).float().mean() < 0.01  # in its last bits: rarely a bf16 ulp
        torch.testing.assert_close(fused, expected, atol=0, rtol=2 ** -6)
    assert cpu_ops.silu_mul(gate_up[:, :399]) is None  # odd width: not a gate/up pair


def test_bf16_rotary_is_bitwise_the_eager_rotation():
    rows, heads, kv_heads, head_dim = 29, 9, 3, 64
    gen = torch.Generator().manual_seed(11)
    rotary = RotaryEmbedding(head_dim, {"rope_theta": 100000.0})
    cos, sin = (t.bfloat16() for t in rotary.cos_sin(torch.randint(0, 900, (rows,),
                                                                    generator=gen)))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    q = qkv[:, :heads * head_dim].reshape(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    expected = torch.cat([rotary.apply(q, cos, sin).reshape(rows, -1),
                          rotary.apply(k, cos, sin).reshape(rows, -1)], dim=1)
    v = qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert cpu_ops.rotary_qk_(qkv, heads + kv_heads, head_dim, cos, sin)
    assert torch.equal(qkv[:, :(heads + kv_heads) * head_dim], expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v)


def test_other_dtypes_and_shapes_keep_the_torch_ops():
    weight = torch.ones(8)
    assert cpu_ops.add_rms_norm(torch.randn(4, 8).half(), None, weight.half(), 1e-6) is None
    assert cpu_ops.add_rms_norm(torch.randn(4, 8).bfloat16(), None, weight, 1e-6) is None
    assert cpu_ops.add_rms_norm(torch.randn(4, 2, 8), None, weight, 1e-6) is None
    cos = sin = torch.ones(4, 1, 8)
    assert not cpu_ops.rotary_qk_(torch.randn(4, 24).bfloat16(), 2, 8, cos, sin)  # fp32 cos
    assert not cpu_ops.rotary_qk_(torch.randn(4, 24).half(), 2, 8, cos.half(), sin.half())
    assert cpu_ops.silu_mul(torch.randn(4, 8).half()) is None
    assert cpu_ops.silu_mul(torch.randn(4, 8).t()) is None


def test_fused_and_eager_layers_give_the_same_logits(tmp_path, monkeypatch):
    from test_models import PagedRun, load
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "llama")
    files, model = load(path)
    prompts = [list(range(40, 61)), list(range(7, 10))]
    fused_tokens, fused_logits = PagedRun(model, files.config).generate(prompts, 6)
    _no_kernels(monkeypatch)
    eager_tokens, eager_logits = PagedRun(model, files.config).generate(prompts, 6)
    assert fused_tokens == eager_tokens
    for a, b in zip(fused_logits, eager_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
