"""The CUDA virtual-memory backend on a real device (skipped without one)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvmem.memory.storage import SlotShape

pytestmark = pytest.mark.cuda

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs a CUDA device and cuda-bindings")


def outside_torch_free() -> int:
    """Free device memory plus what torch's caching allocator holds: the test's own
    temporaries (index tensors, reductions) stay cached by the allocator, the pages do not."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()


@needs_cuda
def test_cuda_pages_map_on_demand_and_hold_data():
    from kvmem.memory.elastic import ElasticKVStorage

    shape = SlotShape(2, 16, 8, 128)  # 64 KiB per block in fp16: 32 blocks per 2 MiB page
    storage = ElasticKVStorage(2, shape, torch.float16, max_blocks=32 * 64, device="cuda:0",
                               reserve_pages=1)
    try:
        queue = storage.free_queue()
        storage.settle()
        free_before = outside_torch_free()
        blocks = queue.pop_n(32 * 16)
        storage.on_blocks_allocated(blocks)
        for s in range(2):
            storage.slot_tensor(s)[blocks] = 2.0
        torch.cuda.synchronize()
        assert float(storage.slot_tensor(1)[blocks].float().mean()) == 2.0
        used = free_before - outside_torch_free()
        assert used >= 0.9 * 16 * storage.stats().page_bytes
        storage.on_blocks_released(blocks)
        queue.push_free(blocks)
        storage.settle()
        assert storage.stats().mapped_pages <= 1 + 2
        assert outside_torch_free() > free_before - 4 * storage.stats().page_bytes
    finally:
        storage.close()
