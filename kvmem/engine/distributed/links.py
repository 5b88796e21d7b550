"""StageLinks: how one rank of a parallel engine exchanges a step's tensors with the others.

The first stage embeds the tokens; a later stage receives the previous stage's hidden
states (each tp rank from the same tp rank of the stage before). The last stage's ranks
compute the logits together (vocab-parallel LM head); its tp rank 0 samples and, unless it
is rank 0 itself, sends the token ids to rank 0. Stages run one after the other for the
whole batch (no micro-batches). ``kvmem.engine.model_runner.ModelRunner`` calls these.
"""

from __future__ import annotations

import torch

from kvmem.engine.distributed import collectives
from kvmem.engine.distributed.state import DistributedGroups


class StageLinks:
    def __init__(self, groups: DistributedGroups, *, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.groups = groups
        self.parallel = groups.parallel
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.samples = self.parallel.rank == self.parallel.sampling_rank

    def receive_hidden(self, num_tokens: int) -> torch.Tensor | None:
        """The previous stage's hidden states (None on the first stage)."""
        if self.groups.prev_rank is None:
            return None
        hidden = torch.empty((num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        return collectives.recv(hidden, self.groups.prev_rank, self.groups.step)

    def send_hidden(self, hidden: torch.Tensor) -> bool:
        """Send this stage's output on; False on the last stage (it computes the logits)."""
        if self.groups.next_rank is None:
            return False
        collectives.send(hidden.contiguous(), self.groups.next_rank, self.groups.step)
        return True

    def gather_tokens(self, tokens: list[int] | None, count: int) -> list[int] | None:
        """The sampled tokens on rank 0 (sent there by the sampling rank); None elsewhere."""
        rank, sampler = self.parallel.rank, self.parallel.sampling_rank
        if rank == sampler:
            if rank != 0:
                collectives.send(torch.tensor(tokens, dtype=torch.long, device=self.device), 0,
                                 self.groups.step)
                return None
            return tokens
        if rank != 0:
            return None
        received = torch.empty(count, dtype=torch.long, device=self.device)
        return collectives.recv(received, sampler, self.groups.step).tolist()
