"""KV storage: one tensor per KV *slot* (see ``kvmem.spec.layout.KVGroup``).

Every slot tensor has shape ``[num_blocks, 2, block_size, kv_heads_on_rank, head_dim]``
(MLA: ``[num_blocks, 1, block_size, 1, latent_dim]``); a decoder layer reads and writes
the tensor of its slot. Block 0 is the null block and is never written by a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SlotShape:
    """Shape of one block in one slot tensor."""

    num_kv: int  # 2 for keys and values, 1 for an MLA latent
    block_size: int
    num_heads: int
    head_dim: int

    @property
    def elements_per_block(self) -> int:
        return self.num_kv * self.block_size * self.num_heads * self.head_dim


class KVStorage(Protocol):
    num_blocks: int

    def slot_tensor(self, slot: int) -> torch.Tensor: ...


class TensorKVStorage:
    """Plain preallocated tensors: the default backend."""

    def __init__(self, num_blocks: int, num_slots: int, shape: SlotShape, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        import torch

        self.num_blocks = num_blocks
        self.shape = shape
        dims = (num_blocks, shape.num_kv, shape.block_size, shape.num_heads, shape.head_dim)
        self._slots = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(num_slots)]

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots)
