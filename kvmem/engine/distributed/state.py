"""Process groups of one parallel engine, built by ``init_distributed`` from a ParallelConfig.

Groups (every rank creates all of them, in the same order):

- the default group (the step backend: ``ParallelConfig.step_backend``, NCCL on GPU and
  gloo on CPU unless ``--distributed-backend`` names one), bounded by ``startup_timeout_s``, over a
  TCP store that the elastic KV cache's page-map startup also uses;
- ``startup``: gloo, for the ranks' agreement on plans and allocations at start;
- ``control``: gloo, for the driver's step broadcasts; a worker may wait on it for as
  long as the engine stays idle, so its bound is long (``IDLE_TIMEOUT``): a dead driver
  ends the wait sooner, by its parent watch (local workers, ``worker.py``) or by the
  closed connection (torchrun ranks);
- ``step``: stage-to-stage hidden states and sampled tokens, bounded by ``timeout_s``;
- ``tp``: this rank's pipeline stage, for the row-parallel all-reduces and the LM head's
  all-gather, bounded by ``timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvmem.engine.distributed.config import ParallelConfig

IDLE_TIMEOUT = timedelta(days=7)  # an idle server is legitimate: not a failure

_tp_group: dist.ProcessGroup | None = None
_host_staged = False  # gloo carries this rank's CUDA tensors: collectives copy via the host


def tp_group() -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (None outside a parallel engine)."""
    return _tp_group


def host_staged() -> bool:
    """Whether a step's CUDA tensors go through host memory for their collectives (the
    gloo backend on CUDA, ``kvmem.engine.distributed.collectives``)."""
    return _host_staged


@dataclass
class DistributedGroups:
    parallel: ParallelConfig
    backend: str
    startup: dist.ProcessGroup
    control: dist.ProcessGroup
    step: dist.ProcessGroup
    tp: dist.ProcessGroup | None
    store: dist.Store | None = None  # the rendezvous store (key-value, bounded waits)

    @property
    def prev_rank(self) -> int | None:
        """The same tp rank in the previous pipeline stage (None on the first stage)."""
        p = self.parallel
        return None if p.pp_stage == 0 else p.rank - p.tensor_parallel_size

    @property
    def next_rank(self) -> int | None:
        p = self.parallel
        last = p.pp_stage == p.pipeline_parallel_size - 1
        return None if last else p.rank + p.tensor_parallel_size


def init_distributed(parallel: ParallelConfig, device: torch.device) -> DistributedGroups:
    """Join the engine's process group with the rank and world size given in ``parallel``."""
    global _tp_group, _host_staged
    backend = parallel.step_backend(device.type)
    step_timeout = timedelta(seconds=parallel.timeout_s)
    startup_timeout = timedelta(seconds=parallel.startup_timeout_s)
    store = dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.world_size,
                          is_master=parallel.rank == 0, timeout=startup_timeout,
                          multi_tenant=True)
    dist.init_process_group(backend, store=store, rank=parallel.rank,
                            world_size=parallel.world_size, timeout=startup_timeout)
    everyone = list(range(parallel.world_size))
    startup = dist.new_group(everyone, timeout=startup_timeout, backend="gloo")
    control = dist.new_group(everyone, timeout=IDLE_TIMEOUT, backend="gloo")
    step = dist.new_group(everyone, timeout=step_timeout, backend=backend)
    own_tp = None
    if parallel.tensor_parallel_size > 1:
        for stage in range(parallel.pipeline_parallel_size):
            group = dist.new_group(parallel.stage_ranks(stage), timeout=step_timeout,
                                   backend=backend)
            if stage == parallel.pp_stage:
                own_tp = group
    _tp_group = own_tp
    _host_staged = backend == "gloo" and device.type == "cuda"
    return DistributedGroups(parallel, backend, startup, control, step, own_tp, store)


def destroy_distributed() -> None:
    global _tp_group, _host_staged
    _tp_group, _host_staged = None, False
    if dist.is_initialized():
        dist.destroy_process_group()
