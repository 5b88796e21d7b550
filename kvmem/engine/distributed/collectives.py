"""A step's tensor collectives and point-to-point sends, on whatever backend carries them.

NCCL and gloo on CPU tensors take the tensors as they are. Gloo carrying CUDA tensors
(``--distributed-backend gloo``, which lets two ranks share one GPU) gets host copies:
whether a given torch build's gloo runs a collective on CUDA tensors is a build option,
and a host copy works with every build. The copy synchronises with the device, so these
steps cannot be captured in a CUDA graph; parallel engines capture none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvmem.engine.distributed.state import host_staged


def _staged(x: torch.Tensor) -> bool:
    return x.is_cuda and host_staged()


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place; returns ``x``."""
    if _staged(x):
        host = x.cpu()
        dist.all_reduce(host, group=group)
        x.copy_(host)
    else:
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``x`` of ``group``, in rank order, on ``x``'s device."""
    local = x.contiguous()
    if _staged(local):
        host = local.cpu()
        parts = [torch.empty_like(host) for _ in range(world)]
        dist.all_gather(parts, host, group=group)
        return [p.to(x.device) for p in parts]
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    return parts


def send(x: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
    dist.send(x.cpu() if _staged(x) else x.contiguous(), dst=dst, group=group)


def recv(x: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Receive into ``x`` from ``src``; returns ``x``."""
    if _staged(x):
        host = torch.empty(x.shape, dtype=x.dtype)
        dist.recv(host, src=src, group=group)
        x.copy_(host)
    else:
        dist.recv(x, src=src, group=group)
    return x
