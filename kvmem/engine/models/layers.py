"""Building blocks with tensor-parallel-style sharding (the field's usual names).

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies its
rank's shard out of the full HuggingFace tensor, so that a checkpoint loads unchanged for
any ``tp_size``. Column-parallel layers split output features, row-parallel layers split
input features and all-reduce their output over the rank's tensor-parallel group
(``kvmem.engine.distributed``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmem.engine.models import cpu_ops, packed_gemm
from kvmem.engine.models.onednn_gemm import OneDNNWeight


def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        from kvmem.engine.distributed import collectives
        from kvmem.engine.distributed.state import tp_group

        collectives.all_reduce(x, tp_group())
    return x


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), lambda p, w, shard_id=None: _copy(p, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops.add_rms_norm(x, None, self.weight, self.eps)
        if fused is not None:
            return fused[1]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, norm(residual + x))``: the residual stream and this norm of it."""
        fused = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        total = x + residual
        return total, self(total)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (Gemma's checkpoints store the gain's offset from
    one), all in fp32 and rounded to the input's dtype once at the end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_and_norm(x, None)[1]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        gain = self.weight.float() + 1.0
        fused = cpu_ops.add_rms_norm(x, residual, gain, self.eps)  # fp32 activations only
        if fused is not None:
            return fused
        total = x if residual is None else x + residual
        x = total.float()
        return total, (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gain
                       ).to(total.dtype)


def store_weight_column_major(weight: nn.Parameter) -> None:
    """Keep ``weight`` ``[out, in]`` as it is but lay it out column-major (after loading).

    On the CPU ``F.linear`` then hands MKL's sgemm ``W^T`` as a contiguous matrix instead of
    a transposed one: 1.0-1.3x faster from 1 to 2,048 rows for this family's fp32
    projections (benchmarks/linear_layout.py). Later loads still copy in by logical index.
    """
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        weight.data = weight.data.t().contiguous().t()


class PackableLinear(nn.Module):
    """A layer computing ``x W^T`` whose CPU weight (fp32 or bf16) can be packed after
    loading."""

    weight: nn.Parameter
    packed: packed_gemm.PackedWeight | OneDNNWeight | None = None

    def pack_weight(self) -> None:
        """After loading: keep the weight only in the layout of the CPU GEMM this process
        uses (MKL's packed or oneDNN's, ``kvmem.engine.models.packed_gemm``) where that
        applies, else lay it out column-major. The parameter stays, empty once packed;
        loading into it again is not supported."""
        packed = packed_gemm.pack(self.weight)
        if packed is None:
            store_weight_column_major(self.weight)
            return
        self.packed = packed
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            return packed_gemm.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all of ``model``'s weights, packed ones included."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.packed.nbytes for m in model.modules()
                        if isinstance(m, PackableLinear) and m.packed is not None)


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W's output rows split over tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"{out_features} output features do not split over {tp_size} ranks")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.out_per_rank = out_features // tp_size
        self.weight = _param((self.out_per_rank, in_features), self.weight_loader)
        self.bias = _param((self.out_per_rank,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.out_per_rank
        _copy(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate + up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp_rank, tp_size)
        self.out_sizes = [n // tp_size for n in out_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size = sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id]
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; KV heads are replicated when tp exceeds them."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1) -> None:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads do not split over {tp_size} ranks")
        self.head_dim = head_dim
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q, self.tp_rank
        else:
            offset, size = (q if shard_id == "k" else q + kv), kv
            rank = self.tp_rank // self.kv_replicas
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv.split([q, kv, kv], dim=-1)


class RowParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W's input columns split over ranks; outputs are summed."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"{in_features} input features do not split over {tp_size} ranks")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_per_rank = in_features // tp_size
        self.weight = _param((out_features, self.in_per_rank), self.weight_loader)
        self.bias = _param((out_features,), lambda p, w, shard_id=None: _copy(p, w)) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.in_per_rank
        _copy(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _all_reduce(self.matmul(x), self.tp_size)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split over ranks (rows outside a rank are 0)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp_size)
        self.start = tp_rank * self.per_rank
        self.weight = _param((self.per_rank, hidden_size), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded[self.start:self.start + self.per_rank]
        param.data.zero_()
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * inside.unsqueeze(-1)
        return _all_reduce(x, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """The output projection to vocabulary logits, split by vocabulary like the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(vocab_size, hidden_size, tp_rank, tp_size)
        self.vocab_size = vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.matmul(hidden)
        if self.tp_size > 1:
            from kvmem.engine.distributed import collectives
            from kvmem.engine.distributed.state import tp_group

            local = torch.cat(collectives.all_gather(local, self.tp_size, tp_group()), dim=-1)
        return local[..., :self.vocab_size]
