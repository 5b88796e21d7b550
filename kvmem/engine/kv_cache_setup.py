"""Size the KV cache with ``kvmem.plan`` and allocate its storage.

The engine never computes a block count itself: it describes its memory to the planner
(an explicit ``kv_cache_memory_bytes``, a CPU budget, or a GPU profile measured after a
dummy forward at ``max_num_batched_tokens``) and takes ``num_blocks`` from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.engine.config import EngineConfig, default_cpu_kv_memory_bytes
from kvmem.memory.storage import SlotShape, TensorKVStorage
from kvmem.spec import ModelSpec


@dataclass
class KVCacheSetup:
    plan: object  # kvmem.plan.Plan
    storage: TensorKVStorage
    kv_caches: list[torch.Tensor]  # one slot tensor per layer
    num_blocks: int

    @property
    def num_gpu_blocks(self) -> int:  # vLLM's name, used in logs
        return self.num_blocks


def plan_kv_cache(spec: ModelSpec, config: EngineConfig, *, device: torch.device,
                  kv_dtype: str, max_model_len: int, profile=None):
    """The planner's answer for this engine (one rank, no parallelism yet)."""
    from kvmem.plan import EngineSettings, Layout, plan

    kv_bytes = config.kv_cache_memory_bytes
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        import psutil

        memory = psutil.virtual_memory().total
        if kv_bytes is None:
            kv_bytes = config.cpu_kv_memory_bytes or default_cpu_kv_memory_bytes()
        profile = None  # on CPU the budget is explicit
    layout = Layout(tensor_parallel_size=1, pipeline_parallel_size=1, layer_partition=None,
                    gpus=None, gpu_memory_bytes=memory)
    settings = EngineSettings(
        gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
        block_size=config.block_size, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        cuda_graphs=False, cpu_offload_bytes=0, kv_cache_dtype=kv_dtype)
    result = plan(spec, layout, settings, policy="uniform",
                  profile=[profile] if profile is not None else None)
    result.check_fit()
    return result


def allocate_kv_cache(spec: ModelSpec, kv_plan, *, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> KVCacheSetup:
    rank = kv_plan.ranks[0]
    num_blocks = kv_plan.engine.num_blocks
    head_dim = next((layer.head_dim for layer in spec.layers if layer.kind.uses_blocks), 0)
    storage = TensorKVStorage(num_blocks, rank.num_slots,
                              SlotShape(2, block_size, rank.kv_heads_on_rank, head_dim),
                              dtype, device)
    slots = spec.layer_slots()
    kv_caches = [storage.slot_tensor(slots[i]) for i in range(spec.num_layers)]
    return KVCacheSetup(plan=kv_plan, storage=storage, kv_caches=kv_caches, num_blocks=num_blocks)
