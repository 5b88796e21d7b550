"""StepInput: one scheduled step as plain lists, broadcast by the driver to every rank.

It carries what the model runner of a single-process engine reads from the scheduler's
requests: token ids, positions, query and sequence lengths, each request's block table
per KV group, and which rows the sampling rank samples with which SamplingParams. With an
elastic KV cache it also carries rank 0's page mapping decisions since the last step,
which the other ranks replay before they run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmem.engine.attention.metadata import AttentionMetadata
from kvmem.engine.request import Request
from kvmem.engine.sampling_params import SamplingParams


@dataclass
class StepInput:
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[list[int]]]  # [group][request] -> block ids
    sample_rows: list[int]  # packed-token rows whose logits are sampled
    sample_request_ids: list[str]
    sample_params: list[SamplingParams]
    finished_request_ids: list[str] = field(default_factory=list)  # drop their generators
    page_ops: list = field(default_factory=list)  # kvmem.memory PageOps, replayed in order
    page_ops_seq: int = 0  # the batch number of page_ops (distributed.page_ops); 0: none

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def from_scheduled(cls, scheduled: list[tuple[Request, int]], kv_cache_manager,
                       num_kv_groups: int) -> StepInput:
        """The step of ``scheduled`` (request, number of new tokens) pairs."""
        step = cls([], [], [], [], [[] for _ in range(num_kv_groups)], [], [], [])
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            step.input_ids.extend(request.all_token_ids[start:start + num_new])
            step.positions.extend(range(start, start + num_new))
            step.query_lens.append(num_new)
            step.seq_lens.append(start + num_new)
            block_ids = kv_cache_manager.get_block_ids(request.request_id)
            for group, ids in zip(step.block_tables, block_ids, strict=True):
                group.append(list(ids))
            if start + num_new == request.num_tokens:  # its last known token: sample
                step.sample_rows.append(len(step.input_ids) - 1)
                step.sample_request_ids.append(request.request_id)
                step.sample_params.append(request.sampling_params)
        return step

    def tensors(self, block_size: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        metadata = AttentionMetadata.build(self.query_lens, self.seq_lens, self.block_tables,
                                           block_size, device=device)
        return (torch.tensor(self.input_ids, dtype=torch.long, device=device),
                torch.tensor(self.positions, dtype=torch.long, device=device), metadata)
