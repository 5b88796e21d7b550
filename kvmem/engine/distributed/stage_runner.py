"""StageRunner: one rank's part of a step, the same code on the driver and on every worker.

The first stage embeds the tokens; a later stage receives the previous stage's hidden
states (each tp rank from the same tp rank of the stage before). The last stage's ranks
compute the logits together (vocab-parallel LM head); its tp rank 0 samples and, unless
it is the driver itself, sends the token ids to the driver. Stages run one after the other
for the whole batch (no micro-batches).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvmem.engine.distributed.state import DistributedGroups
from kvmem.engine.distributed.step import StepInput
from kvmem.engine.sampler import Sampler


class StageRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 groups: DistributedGroups, *, block_size: int, device: torch.device,
                 dtype: torch.dtype, sampler: Sampler, page_map=None) -> None:
        """``page_map``: on ranks other than 0 with an elastic KV cache, the OrderedPageOps
        that replays rank 0's page mapping decisions, in order, before each step."""
        self.model = model
        self.kv_caches = kv_caches
        self.groups = groups
        self.parallel = groups.parallel
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = sampler
        self.page_map = page_map
        self.hidden_size = int(model.config["hidden_size"])
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own generators

    @property
    def samples(self) -> bool:
        return self.parallel.rank == self.parallel.sampling_rank

    @torch.inference_mode()
    def run(self, step: StepInput) -> list[int] | None:
        """Run this rank's layers; the sampling rank returns the sampled token ids."""
        if step.page_ops_seq and self.page_map is not None:
            self.page_map.apply(step.page_ops_seq, step.page_ops)  # before any layer runs
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
        input_ids, positions, metadata = step.tensors(self.block_size, self.device)
        hidden_in = None
        if self.groups.prev_rank is not None:
            hidden_in = torch.empty((step.num_tokens, self.hidden_size), dtype=self.dtype,
                                    device=self.device)
            dist.recv(hidden_in, src=self.groups.prev_rank, group=self.groups.step)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches,
                            hidden_states=hidden_in)
        if self.groups.next_rank is not None:
            dist.send(hidden.contiguous(), dst=self.groups.next_rank, group=self.groups.step)
            return None
        if not step.sample_rows:
            return None
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # every tp rank: an all-gather
        if not self.samples:
            return None
        generators = [self._generator(rid, p.seed)
                      for rid, p in zip(step.sample_request_ids, step.sample_params, strict=True)]
        tokens = self.sampler(logits, step.sample_params, generators)
        if self.parallel.rank != 0:
            dist.send(torch.tensor(tokens, dtype=torch.long, device=self.device), dst=0,
                      group=self.groups.step)
        return tokens

    def receive_tokens(self, step: StepInput) -> list[int]:
        """On the driver: the token ids the sampling rank sent for ``step``."""
        tokens = torch.empty(len(step.sample_rows), dtype=torch.long, device=self.device)
        dist.recv(tokens, src=self.parallel.sampling_rank, group=self.groups.step)
        return tokens.tolist()

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self._generators[request_id]
