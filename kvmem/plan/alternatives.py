"""What would fit instead, when a plan does not: each candidate planned again, not guessed.

Tried in order, each on the same settings and policy:

- another layer partition: the ``optimal`` policy's partition search on the same GPUs;
- an fp8 KV cache, when the cache is 16 bits;
- 8-bit weights (an FP8 or INT8 checkpoint of the model), estimated from the config;
- more GPUs: tensor- and pipeline-parallel sizes doubled (up to 8x each) on GPUs like the
  given ones; the smallest world size at which any of them fits is reported, with every
  layout of that size that fits.

Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvmem.errors import ConfigError
from kvmem.plan.partition import format_partition
from kvmem.plan.types import EngineSettings, Layout, Plan
from kvmem.spec import ModelSpec, dtype_bytes

MAX_DOUBLINGS = 3  # up to 8x the tensor- and pipeline-parallel sizes

Planner = Callable[[ModelSpec, Layout, EngineSettings, str], Plan]


def _fits(planner: Planner, spec: ModelSpec, layout: Layout, settings: EngineSettings,
          policy: str) -> Plan | None:
    try:
        result = planner(spec, layout, settings, policy)
    except ConfigError:  # not a valid layout for this model (heads, layers)
        return None
    return result if result.engine.fits else None


def _same_devices(layout: Layout) -> Layout | None:
    """The layout with one device entry for every rank, if all ranks have the same device."""
    if layout.gpus is not None:
        return replace(layout, gpus=layout.gpus[:1]) if len(set(layout.gpus)) == 1 else None
    mem = layout.gpu_memory_bytes
    if isinstance(mem, (list, tuple)):
        return replace(layout, gpu_memory_bytes=mem[0]) if len(set(mem)) == 1 else None
    return layout


def _bigger_layouts(spec: ModelSpec, layout: Layout) -> list[list[Layout]]:
    """Layouts with doubled tp and/or pp, grouped by world size, smallest first."""
    base = _same_devices(layout)
    if base is None:
        return []
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    by_world: dict[int, list[Layout]] = {}
    for i in range(MAX_DOUBLINGS + 1):
        for j in range(MAX_DOUBLINGS + 1):
            if (i, j) == (0, 0) or pp << j > spec.num_layers:
                continue
            by_world.setdefault((tp << i) * (pp << j), []).append(replace(
                base, tensor_parallel_size=tp << i, pipeline_parallel_size=pp << j,
                layer_partition=None))
    return [by_world[w] for w in sorted(by_world)]


def _layout_text(layout: Layout, result: Plan) -> str:
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    return f"tp {tp} x pp {pp} ({tp * pp} GPUs, {result.engine.tokens:,} tokens)"


def _uses_16_bit_kv(spec: ModelSpec, kv_dtype: str) -> bool:
    paged = any(lay.kind.uses_blocks for lay in spec.layers)
    return paged and dtype_bytes(kv_dtype) == 2


def _usable(failed: Plan) -> int:
    """Memory one GPU may use (with the weights kept in CPU memory); all ranks alike."""
    r = failed.ranks[0]
    return (r.budget_bytes or 0) + failed.settings.cpu_offload_bytes


def _model_weights(planner: Planner, spec: ModelSpec, layout: Layout,
                   settings: EngineSettings) -> int | None:
    """The whole model's weight bytes on one GPU (None: GPU memory not given, so weights
    do not limit), a lower bound on what any larger layout must hold in all."""
    if layout.gpus is None and layout.gpu_memory_bytes is None:
        return None
    one = replace(layout, tensor_parallel_size=1, pipeline_parallel_size=1,
                  layer_partition=None)
    try:
        whole = planner(spec, one, settings, "uniform").ranks[0]
    except ConfigError:
        return None
    return whole.weights_bytes + settings.cpu_offload_bytes


def alternatives(planner: Planner, spec: ModelSpec, failed: Plan, policy: str,
                 profiled: bool) -> list[str]:
    """Short descriptions of what fits instead of ``failed`` (empty if nothing tried fits).

    ``planner(spec, layout, settings, policy)`` plans one candidate; ``profiled``: measured
    ranks, whose figures hold only for the layout they were measured on.
    """
    layout, settings = failed.layout, failed.settings
    found = []
    if layout.pipeline_parallel_size > 1 and (policy != "optimal" or layout.layer_partition):
        best = _fits(planner, spec, replace(layout, layer_partition=None), settings, "optimal")
        if best is not None:
            found.append(f"layer partition {format_partition(best.engine.layer_partition)} "
                         f"with optimal KV budgets ({best.engine.tokens:,} tokens)")
    if _uses_16_bit_kv(spec, failed.engine.kv_dtype):
        fp8 = replace(settings, kv_cache_dtype="fp8")
        if (best := _fits(planner, spec, layout, fp8, policy)) is not None:
            found.append(f"an fp8 KV cache ({best.engine.tokens:,} tokens)")
    if profiled:
        return found
    if spec.weight_bits is None or spec.weight_bits > 8:
        quantised = replace(spec, weight_bits=8)
        if (best := _fits(planner, quantised, layout, settings, policy)) is not None:
            found.append(f"8-bit weights, e.g. an FP8 checkpoint ({best.engine.tokens:,} "
                         "tokens)")
    weights = _model_weights(planner, spec, layout, settings)
    for group in _bigger_layouts(spec, layout):
        if weights is not None and _usable(failed) * group[0].world_size < weights:
            continue  # the GPUs together cannot even hold the weights
        fitting = [(lay, best) for lay in group
                   if (best := _fits(planner, spec, lay, settings, policy)) is not None]
        if fitting:
            found.extend(_layout_text(lay, best) for lay, best in fitting)
            break
    return found
