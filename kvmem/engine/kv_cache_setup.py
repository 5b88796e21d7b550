"""Size the KV cache with ``kvmem.plan`` and allocate its storage.

The engine never computes a block count itself: it describes its memory to the planner
(an explicit ``kv_cache_memory_bytes``, a CPU budget, or a GPU profile measured after a
dummy forward at ``max_num_batched_tokens``) and takes ``num_blocks`` from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.engine.config import EngineConfig, default_cpu_kv_memory_bytes
from kvmem.memory.storage import KVStorage, SlotShape, TensorKVStorage
from kvmem.spec import ModelSpec
from kvmem.spec.state_groups import engine_layer_slots


@dataclass
class KVCacheSetup:
    plan: object  # kvmem.plan.Plan
    storage: KVStorage  # TensorKVStorage, or ElasticKVStorage with --kv-memory elastic
    kv_caches: list[torch.Tensor]  # one slot tensor per layer
    num_blocks: int


def plan_kv_cache(spec: ModelSpec, config: EngineConfig, *, device: torch.device,
                  kv_dtype: str, max_model_len: int, profile=None,
                  memory_bytes: int | list[int] | None = None,
                  layer_partition: list[int] | None = None):
    """The planner's answer for this engine's layout (config's tp x pp and KV budget policy).

    ``profile`` is one RankProfile (or one per rank); ``memory_bytes`` each rank's device
    memory (default: this device's). Not fit-checked here: every rank checks its own
    RankPlan (``kvmem.engine.rank_builder``).
    """
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
    layout = Layout(tensor_parallel_size=config.tensor_parallel_size,
                    pipeline_parallel_size=config.pipeline_parallel_size,
                    layer_partition=layer_partition or config.layer_partition,
                    gpus=None, gpu_memory_bytes=memory_bytes or memory)
    settings = EngineSettings(
        gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
        block_size=config.block_size, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        cuda_graphs=False, cpu_offload_bytes=0, kv_cache_dtype=kv_dtype,
        enable_prefix_caching=config.enable_prefix_caching)
    profiles = profile if isinstance(profile, list) else [profile] if profile else None
    return plan(spec, layout, settings, policy=config.kv_budget, profile=profiles,
                suggest=False)


def allocate_kv_cache(spec: ModelSpec, kv_plan, *, block_size: int, dtype: torch.dtype,
                      device: torch.device, rank: int = 0, elastic=None,
                      views: bool = True) -> KVCacheSetup:
    """``rank``'s KV storage: its RankPlan's slots and heads (a stage of linear-attention
    layers only has the attention's), the engine's block count.

    ``kv_caches`` lists the slot tensor of each layer the rank holds (its pipeline stage).
    With ``elastic`` (a ``kvmem.engine.elastic_setup.ElasticSetup``) the slot tensors are
    views over a reservation backed only where blocks are live, and the block count is the
    reservation's; the planned budget becomes the memory limit. ``views=False`` leaves
    ``kv_caches`` empty, for ranks that must map rank 0's pages first (``layer_views``).
    """
    rank_plan = kv_plan.ranks[rank]
    num_blocks = kv_plan.engine.num_blocks
    head_dim = next((layer.head_dim for layer in spec.layers if layer.kind.uses_blocks), 0)
    shape = SlotShape(2, block_size, rank_plan.kv_heads_on_rank, head_dim)
    if elastic is None:
        storage = TensorKVStorage(num_blocks, rank_plan.num_slots, shape, dtype, device)
    else:
        storage = elastic.build_storage(rank_plan.num_slots, shape, dtype, device)
        num_blocks = storage.num_blocks
    kv_caches = layer_views(spec, rank_plan, storage) if views else []
    return KVCacheSetup(plan=kv_plan, storage=storage, kv_caches=kv_caches, num_blocks=num_blocks)


def layer_views(spec: ModelSpec, rank_plan, storage: KVStorage) -> list[torch.Tensor]:
    """The slot tensor of each layer the rank holds (its pipeline stage), in layer order."""
    slots = engine_layer_slots(spec)
    layers = rank_plan.layers if rank_plan.layers else range(spec.num_layers)
    local = {slot: i for i, slot in enumerate(sorted({slots[i] for i in layers if i in slots}))}
    return [storage.slot_tensor(local[slots[i]]) for i in layers]

