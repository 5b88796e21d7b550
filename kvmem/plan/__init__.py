"""Per-rank KV-cache planning: budgets, bytes per token, blocks, tokens, fit and partition.

>>> from kvmem.plan import plan, Layout, EngineSettings
>>> from kvmem.spec import load_spec
>>> p = plan(load_spec("Qwen/Qwen3-32B"), Layout(pipeline_parallel_size=2,
...          layer_partition=[56, 8]), EngineSettings(kv_cache_memory_bytes=5 << 30,
...          kv_cache_dtype="fp8", max_model_len=40960))
>>> [r.tokens for r in p.ranks]
[46800, 327680]

Imports no torch.
"""

from kvmem.plan.gpus import GPU_MEMORY_GIB, canonical_gpu, gpu_memory_bytes
from kvmem.plan.planner import plan
from kvmem.plan.types import (
    POLICIES,
    EnginePlan,
    EngineSettings,
    FitError,
    Layout,
    Plan,
    RankPlan,
    RankProfile,
)

__all__ = [
    "GPU_MEMORY_GIB", "POLICIES", "EnginePlan", "EngineSettings", "FitError", "Layout", "Plan",
    "RankPlan", "RankProfile", "canonical_gpu", "gpu_memory_bytes", "plan",
]
