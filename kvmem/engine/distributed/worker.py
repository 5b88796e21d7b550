"""A worker rank: set itself up like the driver, then run every step the driver broadcasts.

Local launch: ``worker_main`` is the entry of a spawned process (one per rank > 0). It
ignores SIGINT and SIGTERM, so that a signal sent to the whole process group (Ctrl-C in a
terminal, ``systemctl stop``, ``timeout``) reaches the driver, which stops every worker
cleanly, instead of killing the worker first and looking like a crash; and it exits as
soon as its parent (the driver) is gone, however the driver ended, so it is never left
behind. torchrun launch: ``run_worker`` runs in the ranks > 0 that torchrun started.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from kvmem.engine.distributed.channel import receive_step
from kvmem.engine.distributed.rank_setup import GroupPeers, local_copier
from kvmem.engine.distributed.remote_copy import CopyService
from kvmem.engine.distributed.state import (
    DistributedGroups,
    destroy_distributed,
    init_distributed,
)
from kvmem.engine.model_runner import ModelRunner
from kvmem.engine.rank_builder import RankContext, build_rank, load_rank, rank_context
from kvmem.errors import KvmemError

logger = logging.getLogger("kvmem.engine.distributed")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PARENT_POLL_S = 0.5  # how often a local worker checks that its driver is still there
COPY_STOP_S = 5.0  # how long a stopping worker waits for its copy service to end


def worker_main(ctx: RankContext, handoff: Any) -> None:
    """Process entry of a locally launched worker (multiprocessing spawn)."""
    for sig in STOP_SIGNALS:  # the driver stops us; a group-wide signal is not a crash
        signal.signal(sig, signal.SIG_IGN)
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(ctx, handoff))


def run_worker(ctx: RankContext, handoff: Any = None) -> int:
    """Start this rank and serve steps until the driver says stop; returns an exit code."""
    device = ctx.device
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    try:
        groups = init_distributed(ctx.parallel, device)
        if ctx.profile_only:  # measured and gathered by rank 0: wait for its stop
            load_rank(ctx, GroupPeers(groups))
            receive_step(groups.control)
            return 0
        state = build_rank(ctx, GroupPeers(groups))
        if handoff is not None:
            num_slots = state.kv_plan.ranks[ctx.parallel.rank].num_slots
            handoff.put((ctx.parallel.rank, _shared_slots(state.kv.storage, num_slots, ctx)))
        service = _start_copy_service(ctx, state)
        serve_steps(state.runner, groups)
        if service is not None:  # the driver stopped it before the last step
            service.thread.join(COPY_STOP_S)
        return 0
    except KvmemError as e:  # the driver reports the same error
        logger.debug("%s: %s", ctx.parallel.describe(), e)
        return 1
    except Exception as e:
        logger.error("%s stopped: %s", ctx.parallel.describe(), str(e).splitlines()[0])
        return 1
    finally:
        destroy_distributed()


def serve_steps(runner: ModelRunner, groups: DistributedGroups) -> None:
    """Run each SchedulerOutput the driver broadcasts; ``None`` means stop."""
    while True:
        step = receive_step(groups.control)
        if step is None:
            return
        runner.execute_model(step)


def _start_copy_service(ctx: RankContext, state) -> CopyService | None:
    """This rank's answer to the driver's offload copies, when its KV is not shared."""
    if state.copy_channel is None:
        return None
    local = local_copier(state.kv, state.kv_plan, ctx.parallel.rank)
    return CopyService(local, state.copy_channel, state.page_ops,
                       name=ctx.parallel.describe()).start()


def _shared_slots(storage, num_slots: int, ctx: RankContext) -> list | None:
    """This rank's KV slot tensors moved to shared memory, for the driver's offload tiers."""
    if not ctx.share_kv:
        return None
    slots = [storage.slot_tensor(s) for s in range(num_slots)]
    try:
        for tensor in slots:
            tensor.share_memory_()
    except (OSError, RuntimeError) as e:  # e.g. a small /dev/shm: offloading stays off
        logger.warning("%s: cannot share its KV cache with the driver (%s); CPU offload "
                       "is unavailable", ctx.parallel.describe(), e)
        return None
    return slots


def _exit_with_parent(poll_s: float = PARENT_POLL_S) -> None:
    """Exit within ``poll_s`` once the driver process is gone (however it ended): the
    worker is then re-parented, so its parent pid changes."""
    import multiprocessing

    spawner = multiprocessing.parent_process()  # the driver, even if it is already gone
    parent = spawner.pid if spawner is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="kvmem-parent-watch", daemon=True).start()


def run_launched_worker(config, parallel) -> int:
    """A rank > 0 that a launcher (torchrun) started: serve the driver's steps, no HTTP."""
    from kvmem.engine.loader import resolve_model
    from kvmem.spec import spec_from_config

    files = resolve_model(config.model, load_format=config.load_format)
    return run_worker(rank_context(config, spec_from_config(files.config, files.name), parallel))
