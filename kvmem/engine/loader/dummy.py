"""Random weights for a model given by its config alone (``--load-format dummy``).

Sizing, profiling and speed runs need a model's shape, not its trained values: a
directory with ``config.json`` and ``tokenizer.json`` is enough, and nothing the size of
the weights is read or copied. Matrices are drawn from N(0, 0.02) (the usual
``initializer_range``), norm scales set to one and biases to zero, on the model's own
device, so that activations stay in range.

The weights do not depend on the parallel layout: each matrix is drawn whole, as a
checkpoint would hold it, from a generator seeded by the seed and the matrix's name in the
whole model, and the rank keeps its shard through the parameter's own ``weight_loader``.
So a tensor-parallel engine computes what the same engine at tp 1 computes, and a run is
repeatable.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from kvmem.engine.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

DUMMY_STD = 0.02


def full_parts(module: nn.Module, param: nn.Parameter) -> list[tuple[tuple[int, ...], object]]:
    """The unsharded matrices a checkpoint holds for ``module``'s 2-D ``param``, each with
    the shard id its ``weight_loader`` takes."""
    inner = tuple(param.shape[1:])
    if isinstance(module, QKVParallelLinear):
        q = module.num_heads * module.head_dim * module.tp_size
        kv = module.total_num_kv_heads * module.head_dim
        return [((q, *inner), "q"), ((kv, *inner), "k"), ((kv, *inner), "v")]
    if isinstance(module, MergedColumnParallelLinear):
        return [((n * module.tp_size, *inner), i) for i, n in enumerate(module.out_sizes)]
    if isinstance(module, ColumnParallelLinear):
        return [((module.out_per_rank * module.tp_size, *inner), None)]
    if isinstance(module, RowParallelLinear):
        return [((param.shape[0], module.in_per_rank * module.tp_size), None)]
    if isinstance(module, VocabParallelEmbedding):
        return [((module.vocab_size, *inner), None)]
    return [(tuple(param.shape), None)]


def global_name(model: nn.Module, name: str) -> str:
    """``name`` with a pipeline stage's local layer index made the model's own."""
    parts = name.split(".")
    layer_ids = getattr(model, "layer_ids", None)
    if len(parts) > 2 and parts[0] == "layers" and layer_ids is not None:
        parts[1] = str(int(parts[1]) + layer_ids.start)
    return ".".join(parts)


def _draw(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device).manual_seed(seed)
    # drawn in float32: bf16 normal_ on some devices lacks a generator path
    values = torch.empty(shape, dtype=torch.float32, device=device)
    return values.normal_(0.0, DUMMY_STD, generator=gen)


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of ``model`` in place, then lay the weights out as loading
    does (``process_weights_after_loading``)."""
    owners = {f"{prefix}.{leaf}" if prefix else leaf: module
              for prefix, module in model.named_modules()
              for leaf, _ in module.named_parameters(recurse=False)}
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
            continue
        if param.dim() < 2:  # norm scales
            param.fill_(1.0)
            continue
        module = owners[name]
        tensor = global_name(model, name)
        loader = getattr(param, "weight_loader", None)
        for i, (shape, shard_id) in enumerate(full_parts(module, param)):
            # CPU generators keep 32 bits of a seed: the name and seed are hashed to 32
            full = _draw(shape, param.device, zlib.crc32(f"{seed}:{tensor}:{i}".encode()))
            if loader is None:
                param.copy_(full)
            else:
                loader(param, full.to(param.dtype), shard_id)
    model.process_weights_after_loading()
