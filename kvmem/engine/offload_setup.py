"""Turn CPU/disk offloading (``kvmem.tiers``) on in an ``LLMEngine``.

``attach_offload(engine, config)`` builds the ``OffloadManager`` over the KV storage the
engine's block ids address, wraps it in an ``OffloadConnector`` and hands that to the
scheduler (``Scheduler.offload``). ``LLMEngine`` calls it when ``EngineConfig`` has an
offload budget; tests call it directly to inject faults. ``kvmem.tiers`` knows nothing
about the engine: everything engine-specific (which storage, how many slots, what the
blocks depend on) is decided here.

One process: the storage is the engine's own. Tensor/pipeline parallel: a host row holds
one block of every rank and is stored and loaded whole; the driver reaches the workers'
KV through shared memory (local CPU ranks with plain KV) or through each worker's copy
service (``kvmem.engine.distributed.offload``).

Queued stores are written out when the engine shuts down, or at interpreter exit for an
engine that is never shut down (``kvmem generate``).
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.memory.storage import KVStorage
from kvmem.tiers.config import OffloadConfig
from kvmem.tiers.connector import OffloadConnector
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.manager import OffloadManager
from kvmem.tiers.weights import weights_digest


def offload_storage(engine: Any) -> tuple[KVStorage, int]:
    """The storage holding every slot of the engine's blocks, and its slot count."""
    explicit = getattr(engine, "offload_storage", None)
    if explicit is not None:
        return explicit, explicit.num_slots
    if engine.parallel is not None:
        from kvmem.engine.distributed.offload import parallel_kv_storage

        storage = parallel_kv_storage(engine.parallel)
        return storage, storage.num_slots
    return engine.kv_storage, engine.kv_plan.ranks[0].num_slots


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


def model_identity(engine: Any) -> str:
    """The model part of a tier's identity: architecture, model dtype and a digest of the
    weights themselves (not the path they were loaded from, which may hold other weights
    later or elsewhere)."""
    spec = engine.spec
    dtype = str(engine.dtype).removeprefix("torch.")
    digest = weights_digest(weight_files(engine.config.model))
    return f"{spec.name}|{spec.architecture}|dtype={dtype}|weights={digest}"


def engine_identity(engine: Any) -> tuple[str, str]:
    """(model, layout): what an engine's stored KV blocks depend on besides their tokens.

    The model names the weights by their digest; the layout names the real
    tensor/pipeline layout and layer partition, so a disk tier written by one model or
    layout is never read by another.
    """
    spec = engine.spec
    model = model_identity(engine)
    groups = ";".join(f"{g.kind.value}:{g.window}:{','.join(map(str, g.layers))}"
                      for g in spec.kv_groups())
    if engine.parallel is not None:
        p = engine.parallel.parallel
        stages = engine.parallel.state.allocations[::p.tensor_parallel_size]
        tp, pp, partition = (p.tensor_parallel_size, p.pipeline_parallel_size,
                             [len(a.layers) for a in stages])
    else:
        tp, pp, partition = 1, 1, [spec.num_layers]
    return model, (f"tp={tp} pp={pp} partition={','.join(map(str, partition))} ranks=all "
                   f"groups={groups}")


def attach_offload(engine: Any, config: OffloadConfig,
                   faults: Faults = NO_FAULTS) -> OffloadConnector:
    """Give ``engine`` CPU/disk tiers; returns the connector (also ``engine.offload``)."""
    if getattr(engine, "offload", None) is not None:
        raise ConfigError("offloading is already on for this engine")
    storage, num_slots = offload_storage(engine)
    model, layout = engine_identity(engine)
    manager = OffloadManager(config, storage, num_slots, engine.kv_cache_manager,
                             model=model, layout=layout, faults=faults)
    connector = OffloadConnector(manager, engine.kv_cache_manager)
    engine.scheduler.offload = connector
    engine.offload = connector
    atexit.register(connector.shutdown, flush=True)
    return connector


def shutdown_offload(engine: Any) -> None:
    """Write out queued stores and stop the tiers' threads (idempotent)."""
    connector = getattr(engine, "offload", None)
    if connector is None:
        return
    atexit.unregister(connector.shutdown)
    connector.shutdown(flush=True)
