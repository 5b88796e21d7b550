"""ParallelConfig: the layout and launch of one parallel engine, handed explicitly to every rank.

Rank and world size are fields of this object and nothing else reads them: the driver
builds one per rank before any process group exists, and a ``torchrun`` launch reads its
environment variables once (``from_torchrun_env``) into the same object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvmem.errors import ConfigError
from kvmem.plan.types import rank_label

if TYPE_CHECKING:
    from kvmem.engine.config import EngineConfig

LAUNCHERS = ("local", "torchrun")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    layer_partition: tuple[int, ...] | None = None  # None: the planner's policy decides
    kv_budget_policy: str = "uniform"  # kvmem.plan policy: uniform, proportional, optimal
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the device index on this node
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the driver picks a free port (local launch only)
    timeout_s: float = 60.0  # bound of every wait between ranks during a step
    startup_timeout_s: float = 600.0  # bound of init, weight loading and planning
    launcher: str = "local"  # local: rank 0 spawns the others; torchrun: started outside
    backend: str = "auto"  # a step's process groups: auto (nccl on CUDA, gloo on CPU)

    def __post_init__(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size != tp * pp:
            raise ConfigError(f"world size {self.world_size} is not tensor_parallel_size {tp} x "
                              f"pipeline_parallel_size {pp} = {tp * pp}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size} ranks")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"unknown launcher {self.launcher!r} ({', '.join(LAUNCHERS)})")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown distributed backend {self.backend!r} "
                              f"({', '.join(BACKENDS)})")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ConfigError("distributed timeouts must be positive")

    @property
    def pp_stage(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def sampling_rank(self) -> int:
        """The rank that samples tokens: tp rank 0 of the last pipeline stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def stage_ranks(self, stage: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(stage * tp, (stage + 1) * tp))

    def for_rank(self, rank: int) -> ParallelConfig:
        """The same engine seen from another rank of a local launch."""
        return replace(self, rank=rank, local_rank=rank)

    def describe(self, rank: int | None = None) -> str:
        """``rank 3 (pp stage 1, tp rank 1)``."""
        return rank_label(self.rank if rank is None else rank, self.tensor_parallel_size)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, **launch) -> ParallelConfig:
        """The parallel layout of ``config`` with launch details (rank, port...) given here."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        partition = tuple(config.layer_partition) if config.layer_partition else None
        launch.setdefault("world_size", tp * pp)
        return cls(tensor_parallel_size=tp, pipeline_parallel_size=pp, layer_partition=partition,
                   kv_budget_policy=config.kv_budget, timeout_s=config.distributed_timeout_s,
                   backend=config.distributed_backend, **launch)

    def step_backend(self, device_type: str) -> str:
        """The process-group backend of a step's tensors on ``device_type`` ("cpu" or
        "cuda"): the one asked for, or NCCL on CUDA and gloo on CPU."""
        if self.backend == "auto":
            return "nccl" if device_type == "cuda" else "gloo"
        if self.backend == "nccl" and device_type != "cuda":
            raise ConfigError("the nccl distributed backend needs CUDA devices (use gloo)")
        return self.backend

    def cuda_index(self, device_count: int) -> int:
        """The CUDA device of this rank among ``device_count``: its local rank; with gloo,
        ranks beyond the device count share devices (local rank modulo the count). NCCL
        refuses two ranks on one device, so there the layout must have its own GPU per
        local rank."""
        if self.local_rank < device_count:
            return self.local_rank
        if self.step_backend("cuda") == "gloo" and device_count > 0:
            return self.local_rank % device_count
        raise ConfigError(
            f"{self.describe()} needs cuda:{self.local_rank} but this machine has "
            f"{device_count} CUDA device(s); NCCL cannot run two ranks on one device "
            "(--distributed-backend gloo lets ranks share devices)")


def from_torchrun_env(config: EngineConfig,
                      environ: Mapping[str, str] | None = None) -> ParallelConfig | None:
    """A ParallelConfig from torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* variables.

    Returns None when the process was not started by torchrun (no RANK variable).
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        port = int(env["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"incomplete torchrun environment: {e}") from None
    return ParallelConfig.from_engine_config(
        config, rank=rank, world_size=world, local_rank=local_rank,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=port, launcher="torchrun")
