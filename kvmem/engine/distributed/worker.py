"""A worker rank: set itself up like the driver, then run every step the driver broadcasts.

Local launch: ``worker_main`` is the entry of a spawned process (one per rank > 0). It
ignores SIGINT and SIGTERM, so that a signal sent to the whole process group (Ctrl-C in a
terminal, ``systemctl stop``, ``timeout``) reaches the driver, which stops every worker
cleanly, instead of killing the worker first and looking like a crash; and it exits as
soon as its parent (the driver) is gone, however the driver ended, so it is never left
behind. torchrun launch: ``run_worker`` runs in the ranks > 0 that torchrun started; each
sends heartbeats to the driver (``heartbeat.py``) and exits 2 with one line as soon as rank
0's node is gone (its step broadcast's connection closes or the store stops answering).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvmem.engine.distributed.channel import receive_step
from kvmem.engine.distributed.config import ParallelConfig
from kvmem.engine.distributed.heartbeat import Heartbeat
from kvmem.engine.distributed.rank_setup import GroupPeers, local_copier
from kvmem.engine.distributed.remote_copy import CopyService
from kvmem.engine.distributed.state import (
    DistributedGroups,
    destroy_distributed,
    init_distributed,
)
from kvmem.engine.gc_heap import freeze_startup_heap
from kvmem.engine.model_runner import ModelRunner
from kvmem.engine.rank_builder import RankContext, build_rank, load_rank, rank_context
from kvmem.errors import KvmemError

logger = logging.getLogger("kvmem.engine.distributed")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PARENT_POLL_S = 0.5  # how often a local worker checks that its driver is still there
COPY_STOP_S = 5.0  # how long a stopping worker waits for its copy service to end
_gone = threading.Lock()  # held by the first thread to find the driver gone


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
    heartbeat = None
    try:
        groups = init_distributed(ctx.parallel, device)
        driver_lost = None
        if ctx.parallel.launcher == "torchrun":
            driver_lost = functools.partial(_driver_gone, ctx.parallel)
            heartbeat = Heartbeat(ctx.parallel, driver_lost).start()
        if ctx.profile_only:  # measured and gathered by rank 0: wait for its stop
            load_rank(ctx, GroupPeers(groups))
            receive_step(groups.control)
            return 0
        state = build_rank(ctx, GroupPeers(groups))
        if handoff is not None:
            num_slots = state.kv_plan.ranks[ctx.parallel.rank].num_slots
            handoff.put((ctx.parallel.rank, _shared_slots(state.kv.storage, num_slots, ctx)))
        service = _start_copy_service(ctx, state)
        freeze_startup_heap()
        serve_steps(state.runner, groups, driver_lost)
        if heartbeat is not None:  # stopped by the driver: its node may now go away
            heartbeat.stop()
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
        if heartbeat is not None:
            heartbeat.stop()
        destroy_distributed()


def serve_steps(runner: ModelRunner, groups: DistributedGroups,
                driver_lost: Callable[[str], None] | None = None) -> None:
    """Run each SchedulerOutput the driver broadcasts; ``None`` means stop. A failed wait
    for the next step means the driver is gone: ``driver_lost(reason)``, if given."""
    while True:
        try:
            step = receive_step(groups.control)
        except RuntimeError:  # gloo's "Connection closed by peer" and its advice
            if driver_lost is None:
                raise
            driver_lost("its connection closed while this rank waited for a step")
            raise
        if step is None:
            return
        runner.execute_model(step)


def _driver_gone(parallel: ParallelConfig, reason: str) -> None:
    """Say, once, that rank 0's node is gone, and exit 2 (whatever the main thread waits on)."""
    with _gone:
        print(f"kvmem: error: {parallel.describe()}: rank 0 at {parallel.master_addr} is gone "
              f"({reason}); stopping", file=sys.stderr, flush=True)
        os._exit(2)


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
