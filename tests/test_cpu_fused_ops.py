"""The fused CPU layer steps (fused_ops.c) agree with the eager torch ops they replace."""

import pytest
import torch

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


def test_other_dtypes_and_shapes_keep_the_torch_ops():
    weight = torch.ones(8)
    assert cpu_ops.add_rms_norm(torch.randn(4, 8).bfloat16(), None, weight.bfloat16(),
                                1e-6) is None
    assert cpu_ops.add_rms_norm(torch.randn(4, 2, 8), None, weight, 1e-6) is None
    cos = sin = torch.ones(4, 1, 8)
    assert not cpu_ops.rotary_qk_(torch.randn(4, 24).bfloat16(), 2, 8, cos, sin)
    norm = RMSNorm(8, 1e-6).to(torch.bfloat16)  # as a bf16 model holds it
    norm.weight.data.fill_(1.0)
    x = torch.randn(4, 8).bfloat16()
    total, normed = norm.add_and_norm(x, x)
    assert total.dtype == normed.dtype == torch.bfloat16


def test_fused_and_eager_layers_give_the_same_logits(tmp_path, monkeypatch):
    from test_models import PagedRun, load
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "llama")
    files, model = load(path)
    prompts = [list(range(40, 61)), list(range(7, 10))]
    fused_tokens, fused_logits = PagedRun(model, files.config).generate(prompts, 6)
    monkeypatch.setattr(cpu_ops, "_fused", lambda *tensors: False)
    eager_tokens, eager_logits = PagedRun(model, files.config).generate(prompts, 6)
    assert fused_tokens == eager_tokens
    for a, b in zip(fused_logits, eager_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
