"""CPU/disk offloading (``kvmem.tiers``) for an engine, built before its scheduler.

``build_offload`` makes the ``OffloadManager`` over the KV storage the engine's block ids
address, wraps it in an ``OffloadConnector`` and returns it; the engine hands it to the
``Scheduler``'s constructor. ``kvmem.tiers`` knows nothing about the engine: everything
engine-specific (which storage, how many slots, what the blocks depend on) is decided
here and by the engine.

One process: the storage is the engine's own. Tensor/pipeline parallel: a host row holds
one block of every rank and is stored and loaded whole; rank 0 reaches the workers' KV
through shared memory (local CPU ranks with plain KV) or through each worker's copy
service (``kvmem.engine.distributed.offload``).

Queued stores are written out when the engine shuts down, or at interpreter exit for an
engine that is never shut down (``kvmem generate``).
"""

from __future__ import annotations

import atexit
from pathlib import Path

import torch

from kvmem.cache import KVCacheManager
from kvmem.memory.storage import KVStorage
from kvmem.spec import AttentionKind, ModelSpec
from kvmem.spec.layout import KVGroup
from kvmem.spec.state_groups import engine_kv_groups
from kvmem.tiers.config import OffloadConfig
from kvmem.tiers.connector import OffloadConnector
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.manager import OffloadManager
from kvmem.tiers.stats import PrefillMeter
from kvmem.tiers.weights import weights_digest


def weight_files(source: str | None) -> list[Path]:
    """The files holding the weights of ``source`` (``EngineConfig.model``): a checkpoint
    directory's safetensors files, or the GGUF file (the embedded model's included)."""
    from kvmem.engine.loader import EMBEDDED_NAMES, resolve_model
    from kvmem.engine.loader.gguf_convert import embedded_gguf

    if source is None or str(source).lower() in EMBEDDED_NAMES:
        return [embedded_gguf()]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    return resolve_model(source).weight_files


def model_identity(spec: ModelSpec, dtype: torch.dtype, source: str | None,
                   dummy_seed: int | None = None) -> str:
    """The model part of a tier's identity: architecture, model dtype and a digest of the
    weights themselves (not the path they were loaded from, which may hold other weights
    later or elsewhere); random weights (``dummy_seed``) are named by their seed."""
    name = str(dtype).removeprefix("torch.")
    digest = (f"dummy-{dummy_seed}" if dummy_seed is not None
              else weights_digest(weight_files(source)))
    return f"{spec.name}|{spec.architecture}|dtype={name}|weights={digest}"


def tier_identity(spec: ModelSpec, dtype: torch.dtype, source: str | None, *,
                  tensor_parallel_size: int, partition: list[int],
                  dummy_seed: int | None = None) -> tuple[str, str]:
    """(model, layout): what an engine's stored KV blocks depend on besides their tokens.

    The model names the weights by their digest; the layout names the real
    tensor/pipeline layout, layer partition (layers per stage) and KV groups (a hybrid's
    state groups with their states), so a disk tier written by one model or layout is
    never read by another.
    """
    groups = ";".join(_group_layout(spec, g) for g in engine_kv_groups(spec))
    return model_identity(spec, dtype, source, dummy_seed), (
        f"tp={tensor_parallel_size} pp={len(partition)} "
        f"partition={','.join(map(str, partition))} ranks=all groups={groups}")


def _group_layout(spec: ModelSpec, group: KVGroup) -> str:
    """A KV group as the blocks it stores depend on: its kind, window and layers, and,
    for a state group (a linear-attention hybrid's), its layers' state."""
    layout = f"{group.kind.value}:{group.window}:{','.join(map(str, group.layers))}"
    if group.kind is AttentionKind.LINEAR:  # the state's every field, from its dataclass
        layout += f":{spec.layers[group.layers[0]].state!r}"
    return layout


def build_offload(config: OffloadConfig, kv_cache_manager: KVCacheManager, storage: KVStorage,
                  num_slots: int, identity: tuple[str, str],
                  faults: Faults = NO_FAULTS, prefill: PrefillMeter | None = None
                  ) -> OffloadConnector:
    """The tiers over ``storage`` (``num_slots`` slots per block) as the scheduler uses them;
    ``prefill``: the engine's measured prefill rate, which values their hits."""
    model, layout = identity
    manager = OffloadManager(config, storage, num_slots, kv_cache_manager, model=model,
                             layout=layout, faults=faults, prefill=prefill)
    connector = OffloadConnector(manager, kv_cache_manager)
    atexit.register(connector.shutdown, flush=True)
    return connector


def shutdown_offload(connector: OffloadConnector | None) -> None:
    """Write out queued stores and stop the tiers' threads (idempotent)."""
    if connector is None:
        return
    atexit.unregister(connector.shutdown)
    connector.shutdown(flush=True)
