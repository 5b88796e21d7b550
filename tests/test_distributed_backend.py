"""``--distributed-backend``: which process-group backend carries a step's tensors, and
which CUDA device each rank takes (gloo lets ranks share one GPU; NCCL cannot)."""

from __future__ import annotations

import argparse

import pytest

from kvmem.engine.config import EngineConfig, add_engine_arguments
from kvmem.engine.distributed.config import ParallelConfig
from kvmem.errors import ConfigError


def parallel(backend: str, rank: int = 0, tp: int = 2) -> ParallelConfig:
    config = EngineConfig(tensor_parallel_size=tp, distributed_backend=backend)
    return ParallelConfig.from_engine_config(config).for_rank(rank)


def test_the_flag_reaches_every_rank_through_the_parallel_config():
    args = argparse.ArgumentParser()
    add_engine_arguments(args)
    config = EngineConfig.from_args(args.parse_args(["-tp", "2", "--distributed-backend",
                                                     "gloo"]))
    assert config.distributed_backend == "gloo"
    assert ParallelConfig.from_engine_config(config).for_rank(1).backend == "gloo"
    assert EngineConfig().distributed_backend == "auto"


def test_unknown_or_impossible_backends_are_one_line_errors():
    with pytest.raises(ConfigError, match="unknown --distributed-backend 'mpi'"):
        args = argparse.ArgumentParser()
        add_engine_arguments(args)
        EngineConfig.from_args(argparse.Namespace(
            **{**vars(args.parse_args([])), "distributed_backend": "mpi"}))
    with pytest.raises(ConfigError, match="nccl needs a CUDA device"):
        EngineConfig(device="cpu", distributed_backend="nccl")
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        parallel("nccl").step_backend("cpu")


@pytest.mark.parametrize("backend,device,expected", [
    ("auto", "cuda", "nccl"), ("auto", "cpu", "gloo"), ("gloo", "cuda", "gloo"),
    ("gloo", "cpu", "gloo"), ("nccl", "cuda", "nccl")])
def test_step_backend(backend, device, expected):
    assert parallel(backend).step_backend(device) == expected


def test_each_rank_has_its_own_gpu_when_there_are_enough():
    assert [parallel("auto", r, tp=4).cuda_index(4) for r in range(4)] == [0, 1, 2, 3]
    assert [parallel("gloo", r, tp=4).cuda_index(8) for r in range(4)] == [0, 1, 2, 3]


def test_gloo_ranks_share_gpus_and_nccl_ranks_cannot():
    assert [parallel("gloo", r).cuda_index(1) for r in range(2)] == [0, 0]
    assert [parallel("gloo", r, tp=4).cuda_index(2) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match=r"rank 1 .*needs cuda:1 but this machine has 1 "
                                          r"CUDA device.*--distributed-backend gloo"):
        parallel("auto", 1).cuda_index(1)
    with pytest.raises(ConfigError, match="0 CUDA device"):
        parallel("gloo", 1).cuda_index(0)


def test_collectives_pass_cpu_tensors_to_gloo_as_they_are(tmp_path):
    """One-rank gloo group: the wrappers' plain path (host staging is for CUDA tensors)."""
    import torch
    import torch.distributed as dist

    from kvmem.engine.distributed import collectives

    store = dist.FileStore(str(tmp_path / "store"), 1)
    group_was = dist.is_initialized()
    if not group_was:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.arange(4.0)
        assert collectives.all_reduce(x, None) is x and x.tolist() == [0, 1, 2, 3]
        parts = collectives.all_gather(x.view(2, 2).t(), 1, None)
        assert [p.tolist() for p in parts] == [[[0, 2], [1, 3]]]
    finally:
        if not group_was:
            dist.destroy_process_group()
