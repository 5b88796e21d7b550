"""One step's messages: the scheduler's ``SchedulerOutput`` and the runners' ``ModelRunnerOutput``.

``SchedulerOutput`` holds everything a rank needs to run a step, as plain data (it is
pickled and broadcast to every rank of a parallel engine, and handed as is to the runner
of a single-process one):

- requests the runners have not seen (new, or resumed after preemption): their token ids,
  block table per KV group, computed tokens and sampling parameters;
- requests the runners already hold: the tokens appended since (the previous step's
  samples), the block ids added to each group's table and how many leading entries of
  each table now point at the null block (blocks that left a sliding window);
- how many tokens each request computes this step, in batch order;
- requests finished or preempted since the last step (the runners drop their state; a
  preempted request keeps its sampling state, a seeded generator);
- with an elastic KV cache, rank 0's page mapping decisions since the last step.

Runners never ask the cache manager anything: block ids reach them only here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.engine.errors import RequestFailure
from kvmem.engine.outputs import PositionLogprobs
from kvmem.engine.sampling_params import SamplingParams

BlockIds = tuple[list[int], ...]  # per KV group


@dataclass
class NewRequestData:
    """A request the runners do not hold yet, with all they keep about it."""

    req_id: str
    token_ids: list[int]  # prompt and output tokens known so far
    block_ids: BlockIds
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0  # the first token_ids: penalties tell prompt from output
    eos_token_ids: tuple[int, ...] = ()  # min_tokens keeps them from being sampled


@dataclass
class CachedRequestData:
    """What changed for a request the runners already hold."""

    req_id: str
    new_token_ids: list[int]  # appended since the runners last saw it
    new_block_ids: BlockIds
    num_null_blocks: tuple[int, ...]  # per group: leading entries now the null block
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    page_ops: list = field(default_factory=list)  # kvmem.memory PageOps, replayed in order
    page_ops_seq: int = 0  # the batch number of page_ops (distributed.page_ops); 0: none

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """The token sampled for each request that completed its known tokens this step, the
    logprobs of the requests that asked (a single-process engine only), and the requests
    whose own part of the step failed (they fail alone; the others' results stand)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # request id -> (position of the first prompt token scored, its logprobs in order)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    failures: dict[str, RequestFailure] = field(default_factory=dict)

