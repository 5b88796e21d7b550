"""The driver: rank 0 of a parallel engine, which also runs the scheduler and the KV cache
manager and is tp rank 0 of pipeline stage 0.

``start_parallel`` spawns the local workers (or joins ranks torchrun started), sets rank 0
up like every other rank, and watches the workers. The engine's ``Executor`` broadcasts
each step through ``broadcast`` and runs rank 0's part itself. A worker that dies, or a
step that fails or times out, stops the engine with one error naming the rank; every later
step raises the same error. Ranks that torchrun started are watched through their
heartbeats (``heartbeat.py``), so a dead node is found even while the server is idle.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kvmem.engine.distributed.channel import broadcast_step
from kvmem.engine.distributed.config import ParallelConfig
from kvmem.engine.distributed.errors import ParallelError, StartupError, WorkerDiedError
from kvmem.engine.distributed.heartbeat import PeerWatch, first_line
from kvmem.engine.distributed.page_ops import PageOpsFeed
from kvmem.engine.distributed.rank_setup import GroupPeers, local_copier
from kvmem.engine.distributed.remote_copy import RemoteBlockCopier
from kvmem.engine.distributed.state import destroy_distributed, init_distributed
from kvmem.engine.distributed.worker import worker_main
from kvmem.engine.memory_profile import MemoryProfile
from kvmem.engine.rank_builder import RankContext, RankState, build_rank, load_rank
from kvmem.engine.step import SchedulerOutput
from kvmem.errors import ConfigError

if TYPE_CHECKING:
    from kvmem.engine.elastic_setup import StepGate

logger = logging.getLogger("kvmem.engine.distributed")

DEATH_NOTICE_S = 3.0  # how long a failed step waits for the watchdog to name a dead worker
WATCH_S = 0.2  # how often the watchdog looks at the workers
PEER_NOTICE_S = 2.5  # after a failed step or a stop, this much silence names a torchrun rank


def hold_rendezvous(parallel: ParallelConfig) -> dist.TCPStore:
    """The rendezvous store's server on a port the OS picks, bound before any worker
    starts and held until the engine stops (``init_distributed``'s store shares it). A
    port picked, closed and bound later could be taken meanwhile by another engine starting
    on this machine, whose ranks this engine's workers would then join."""
    return dist.TCPStore(parallel.master_addr, 0, None, is_master=True,
                         timeout=timedelta(seconds=parallel.startup_timeout_s),
                         wait_for_workers=False, multi_tenant=True)


def start_parallel(ctx: RankContext, steps: StepGate | None = None) -> ParallelDriver:
    """Start every rank of ``ctx``'s tp x pp layout and return the driver (rank 0). With
    ``ctx.profile_only`` the ranks only measure themselves (``ParallelDriver.profiles``).
    ``steps``: the engine's step lock and loop wake (``build_rank``)."""
    parallel = ctx.parallel
    if parallel.rank != 0:
        raise ConfigError(f"{parallel.describe()} is a worker; only rank 0 runs the engine")
    rendezvous = None
    if parallel.launcher == "local" and parallel.master_port == 0:
        rendezvous = hold_rendezvous(parallel)
        ctx = replace(ctx, parallel=replace(parallel, master_port=rendezvous.port))
    driver = ParallelDriver(ctx, rendezvous, steps)
    try:
        driver.start()
    except BaseException:
        driver.shutdown()
        raise
    return driver


class ParallelDriver:
    def __init__(self, ctx: RankContext, rendezvous: dist.TCPStore | None = None,
                 steps: StepGate | None = None) -> None:
        self.ctx = ctx
        self.steps = steps  # rank 0's engine's step lock and loop wake
        self.parallel = ctx.parallel
        self._rendezvous = rendezvous  # holds the port until shutdown (hold_rendezvous)
        self.processes: dict[int, Any] = {}  # rank -> multiprocessing.Process (local launch)
        self.state: RankState | None = None
        self.profiles: list[MemoryProfile] | None = None  # every rank's, when profiling
        self.shared_slots: list[torch.Tensor] | None = None  # every rank's KV, rank order
        self.page_feed: PageOpsFeed | None = None  # elastic page decisions, numbered
        self.remote_copier: RemoteBlockCopier | None = None  # offload without shared KV
        self.peers: PeerWatch | None = None  # heartbeats of ranks torchrun started
        self.error: ParallelError | None = None
        self._failure_callbacks: list[Callable[[ParallelError], None]] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._closed = False

    # -- start ---------------------------------------------------------------------------
    def start(self) -> None:
        atexit.register(self.shutdown)
        handoff = None
        if self.parallel.launcher == "local":
            import torch.multiprocessing as mp

            spawn = mp.get_context("spawn")
            handoff = spawn.Queue() if self.ctx.share_kv else None
            for rank in range(1, self.parallel.world_size):
                proc = spawn.Process(target=worker_main, args=(self.ctx.for_rank(rank), handoff),
                                     name=f"kvmem-rank{rank}", daemon=True)
                proc.start()
                self.processes[rank] = proc
                logger.info("%s: worker pid %d", self.parallel.describe(rank), proc.pid)
        device = self.ctx.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.groups = self._bounded("joining the process group",
                                    lambda: init_distributed(self.parallel, device))
        if self.ctx.profile_only:
            self.profiles = self._bounded("measuring", lambda: load_rank(
                self.ctx, GroupPeers(self.groups)).profiles)
            return
        self.state = self._bounded("starting",
                                   lambda: build_rank(self.ctx, GroupPeers(self.groups),
                                                      self.steps))
        if handoff is not None:
            self.shared_slots = self._collect_shared_slots(handoff)
        if self.state.elastic is not None:
            self.page_feed = PageOpsFeed(self.state.elastic)
        if self.state.copy_channel is not None:
            self.remote_copier = RemoteBlockCopier(
                local_copier(self.state.kv, self.state.kv_plan, 0), self.state.copy_channel,
                self.page_feed)
        if self.parallel.launcher == "torchrun":
            self.peers = PeerWatch(self.parallel)
        threading.Thread(target=self._watch, name="kvmem-rank-watchdog", daemon=True).start()
        for a in self.state.allocations:
            logger.info("%s: layers %d-%d, %d KV heads, %d blocks, %d KV bytes allocated",
                        self.parallel.describe(a.rank), a.layers[0], a.layers[-1],
                        a.kv_heads_on_rank, a.num_blocks, a.allocated_bytes)

    def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a startup phase, failing fast if a worker dies and at the startup timeout."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = fn()
            except BaseException as e:  # handed to the caller's thread below
                box["error"] = e

        thread = threading.Thread(target=target, name="kvmem-startup", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.parallel.startup_timeout_s
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead_worker()
            if dead is not None and thread.is_alive():
                thread.join(DEATH_NOTICE_S)  # let the phase report the worker's own error
                if "error" in box and not isinstance(box["error"], RuntimeError):
                    break
                rank, code = dead
                raise StartupError(f"{self.parallel.describe(rank)} exited with code {code} "
                                   f"while {what}")
            if time.monotonic() > deadline:
                raise StartupError(f"timed out after {self.parallel.startup_timeout_s:.0f} s "
                                   f"while {what}")
        if "error" in box:
            error = box["error"]
            if isinstance(error, RuntimeError) and not isinstance(error, ParallelError):
                raise StartupError(f"{what} failed: {str(error).splitlines()[0]}") from error
            raise error
        return box["result"]

    def _collect_shared_slots(self, handoff) -> list[torch.Tensor] | None:
        own = self.state.kv.storage
        slots_by_rank = {0: [own.slot_tensor(s)
                             for s in range(self.state.kv_plan.ranks[0].num_slots)]}
        deadline = time.monotonic() + self.parallel.startup_timeout_s
        while len(slots_by_rank) < self.parallel.world_size:
            try:
                rank, slots = handoff.get(timeout=0.2)
            except queue.Empty:
                if self._dead_worker() is not None or time.monotonic() > deadline:
                    raise StartupError("a worker did not hand over its KV cache") from None
                continue
            slots_by_rank[rank] = slots
        if any(s is None for s in slots_by_rank.values()):
            return None
        return [t for rank in sorted(slots_by_rank) for t in slots_by_rank[rank]]

    # -- liveness ------------------------------------------------------------------------
    def on_failure(self, callback: Callable[[ParallelError], None]) -> None:
        """Call ``callback(error)`` (from any thread) when the engine stops on a failure."""
        self._failure_callbacks.append(callback)

    def _dead_worker(self) -> tuple[int, int | None] | None:
        for rank, proc in self.processes.items():
            if not proc.is_alive():
                return rank, proc.exitcode
        return None

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            dead = self._dead_worker()
            error = self._death_error(*dead) if dead is not None else self._silent_peer()
            if error is not None:
                self._fail(error)
                return

    def _silent_peer(self) -> ParallelError | None:
        """A torchrun rank whose heartbeat stopped, or the rendezvous store's loss."""
        if self.peers is None:
            return None
        try:
            self.peers.poll()
        except Exception as e:  # the store lives with this node's torchrun agent
            p = self.parallel
            return ParallelError(f"the rendezvous store at {p.master_addr}:{p.master_port} is "
                                 f"gone ({first_line(e)}); the engine stopped")
        found = self.peers.silent()
        return None if found is None else self._gone_error(*found)

    def _gone_error(self, rank: int, silence_s: float) -> WorkerDiedError:
        return WorkerDiedError(f"{self.parallel.describe(rank)} on {self.peers.where[rank]} is "
                               f"gone: no heartbeat for {silence_s:.0f} s; the engine stopped",
                               rank)

    def _death_error(self, rank: int, code: int | None) -> WorkerDiedError:
        pid = self.processes[rank].pid
        return WorkerDiedError(f"{self.parallel.describe(rank)} (pid {pid}) died with exit "
                               f"code {code}; the engine stopped", rank)

    def _fail(self, error: ParallelError) -> ParallelError:
        with self._lock:
            if self.error is not None or self._stopping.is_set():
                return self.error or error
            self.error = error
        logger.error("%s", error)
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:  # a callback must not stop the others
                logger.exception("failure callback raised")
        return error

    # -- steps ---------------------------------------------------------------------------
    def broadcast(self, out: SchedulerOutput) -> None:
        """Send one step to every worker (bounded by the step timeout)."""
        broadcast_step(out, self.groups.control, self.parallel.timeout_s)

    def step_failed(self, exc: BaseException) -> ParallelError:
        """The error to raise for a step whose communication failed with ``exc``."""
        if self.error is not None:
            return self.error
        deadline = time.monotonic() + (DEATH_NOTICE_S if self.processes else 0)
        while time.monotonic() < deadline:
            dead = self._dead_worker()
            if dead is not None:
                return self._fail(self._death_error(*dead))
            time.sleep(0.05)
        if self.peers is not None:  # a closed connection: is a rank's heartbeat gone too?
            found = self.peers.wait_silent(PEER_NOTICE_S)
            if found is not None:
                return self._fail(self._gone_error(*found))
        return self._fail(ParallelError(f"a distributed step failed (a rank stopped answering "
                                        f"within {self.parallel.timeout_s:.0f} s or its "
                                        f"connection closed): {first_line(exc)}"))

    def check_peers(self) -> ParallelError | None:
        """Before a requested stop of ranks torchrun started: the error of a rank whose
        heartbeat has stopped, if one has. torchrun's agent stops rank 0 (SIGTERM) when it
        loses the rendezvous of a node that died, which should not read as a clean stop."""
        if self.peers is None or self.error is not None:
            return self.error
        found = self.peers.wait_silent(PEER_NOTICE_S)
        return None if found is None else self._fail(self._gone_error(*found))

    # -- stop ----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every worker and leave the process group (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        healthy = self.error is None and (self.state is not None or self.profiles is not None)
        self._stopping.set()
        if healthy:
            if self.remote_copier is not None:
                with contextlib.suppress(Exception):  # a dead worker's error is reported
                    self.remote_copier.close()
            with contextlib.suppress(Exception):  # a worker already gone is stopped below
                broadcast_step(None, self.groups.control, timeout)
        # after a failure no stop broadcast comes: the workers left would wait for it
        deadline = time.monotonic() + (timeout if self.error is None else 0.0)
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes.values():
            if proc.is_alive():  # local workers ignore SIGTERM: only SIGKILL stops them
                proc.kill()
                proc.join(2.0)
        destroy_distributed()
        self._rendezvous = None
        atexit.unregister(self.shutdown)
