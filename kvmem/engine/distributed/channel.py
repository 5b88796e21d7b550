"""The driver's step channel: a pickled object broadcast from rank 0 over a gloo group.

Workers wait on it without a short bound (an idle server sends nothing for as long as it
is idle; a dead driver closes the connection), while the driver's side of every
broadcast is bounded by the step timeout, so a frozen worker cannot hold the driver.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def broadcast_step(obj: Any, group: dist.ProcessGroup, timeout_s: float) -> None:
    """Send ``obj`` from rank 0 to every rank; raises if a rank does not take it in time."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.long)
    for tensor in (size, payload):
        work = dist.broadcast(tensor, src=0, group=group, async_op=True)
        if not work.wait(timeout=timedelta(seconds=timeout_s)):
            raise TimeoutError(f"a rank did not take the step within {timeout_s:.0f} s")


def receive_step(group: dist.ProcessGroup) -> Any:
    """A worker's side of ``broadcast_step``."""
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())
