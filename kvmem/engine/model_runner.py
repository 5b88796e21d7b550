"""ModelRunner: one rank's part of a step, the same code at every world size.

It keeps what the scheduler's messages told it about each request (token ids, block table
per KV group, computed tokens, sampling parameters), applies each ``SchedulerOutput``'s
changes, packs the scheduled tokens into one flat batch (the slot of every new token
derived from the block table), runs its layers and samples.

Alone (world size 1) it is the whole model and samples. In a tensor x pipeline parallel
engine (``links``, ``kvmem.engine.distributed.links``) a later stage receives the previous
stage's hidden states, a stage that is not the last sends its own on, the last stage's
ranks compute the logits together, and its tp rank 0 samples and sends the tokens to
rank 0. Seeded requests sample from their own generator, kept here by request id until
the request finishes (a preempted request keeps it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from kvmem.engine.attention.metadata import AttentionMetadata, StateMetadata
from kvmem.engine.errors import RequestFailed, RequestFailure, request_stage
from kvmem.engine.logprobs import position_logprobs
from kvmem.engine.outputs import PositionLogprobs
from kvmem.engine.sampler import FAILED, Sampler
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kvmem.engine")
T = TypeVar("T")
K = TypeVar("K")


class StageLinks(Protocol):
    """How a rank of a parallel engine talks to its neighbours during a step."""

    samples: bool  # this rank samples (tp rank 0 of the last stage)

    def receive_hidden(self, num_tokens: int) -> torch.Tensor | None: ...

    def send_hidden(self, hidden: torch.Tensor) -> bool: ...  # False on the last stage

    def gather_tokens(self, tokens: list[int] | None, count: int) -> list[int] | None: ...


class PageMapReplay(Protocol):
    """Replays rank 0's elastic page decisions on another rank, in order."""

    def apply(self, seq: int, ops: list) -> None: ...


@dataclass
class CachedRequestState:
    token_ids: list[int]
    block_ids: list[list[int]]  # per KV group
    num_null_blocks: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def min_tokens_ban(self) -> list[int] | None:
        """The token ids the sampler must not pick yet: EOS (unless ignored) and the stop
        token ids, while fewer than ``min_tokens`` tokens are generated."""
        p = self.sampling_params
        if len(self.token_ids) - self.num_prompt_tokens >= p.min_tokens:
            return None
        return [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)] or None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], *,
                 num_kv_groups: int, block_size: int, device: torch.device, sampler: Sampler,
                 links: StageLinks | None = None, page_map: PageMapReplay | None = None,
                 state_groups: tuple[int, ...] = ()) -> None:
        """``state_groups``: the KV groups whose blocks hold linear-attention states."""
        self.model = model
        self.kv_caches = kv_caches
        self.num_kv_groups = num_kv_groups
        self.state_groups = state_groups
        self.attention_groups = [g for g in range(num_kv_groups) if g not in state_groups]
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.links = links
        self.page_map = page_map
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own generators
        self.cuda_graphs = None  # a CUDAGraphRunner once capture_cuda_graphs has run

    @property
    def samples(self) -> bool:
        return self.links is None or self.links.samples

    def capture_cuda_graphs(self, batch_sizes: list[int], max_model_len: int) -> None:
        """Capture the decode forward for ``batch_sizes`` over this runner's KV cache (GPU);
        not for a linear-attention hybrid, whose states are not captured."""
        if self.state_groups:
            return
        from kvmem.engine.cuda_graphs import CUDAGraphRunner

        graphs = CUDAGraphRunner(self.model, self.kv_caches, num_kv_groups=self.num_kv_groups,
                                 block_size=self.block_size, max_model_len=max_model_len,
                                 batch_sizes=batch_sizes, device=self.device)
        graphs.capture()
        self.cuda_graphs = graphs

    # -- state ----------------------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's changes to the requests this runner holds."""
        if out.page_ops_seq and self.page_map is not None:
            self.page_map.apply(out.page_ops_seq, out.page_ops)  # before any layer runs
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                list(new.token_ids), [list(t) for t in new.block_ids], [0] * len(new.block_ids),
                new.num_computed_tokens, new.sampling_params, new.num_prompt_tokens,
                new.eos_token_ids)
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            for g, ids in enumerate(cached.new_block_ids):
                if ids:
                    state.block_ids[g].extend(ids)
            for g, n in enumerate(cached.num_null_blocks):
                table, done = state.block_ids[g], state.num_null_blocks[g]
                if n > done:  # blocks that left a sliding window: the null block now
                    table[done:n] = [0] * (n - done)
                    state.num_null_blocks[g] = n

    def prepare_inputs(self, out: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                  list[str]]:
        """Packed token ids, positions, attention metadata, and the rows (with their
        request ids) whose logits are sampled: each request that completes its tokens."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens = [], []
        tables: list[list[list[int]]] = [[] for _ in self.attention_groups]
        reads: list[list[int]] = [[] for _ in self.state_groups]
        writes: list[list[int]] = [[] for _ in self.state_groups]
        sample_rows, sample_ids = [], []
        for rid, num_new in out.num_scheduled_tokens.items():
            state = self.requests[rid]
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            for group, g in zip(tables, self.attention_groups, strict=True):
                group.append(state.block_ids[g])
            for read, write, g in zip(reads, writes, self.state_groups, strict=True):
                self._state_blocks(state.block_ids[g], start, start + num_new, read, write)
            if start + num_new == len(state.token_ids):  # its last known token: sample
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(rid)
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size,
                                           device=self.device)
        if self.state_groups:
            metadata.states = StateMetadata(
                [torch.tensor(r, dtype=torch.long, device=self.device) for r in reads],
                [torch.tensor(w, dtype=torch.long, device=self.device) for w in writes])
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), metadata,
                sample_rows, sample_ids)

    def _state_blocks(self, table: list[int], start: int, end: int, read: list[int],
                      write: list[int]) -> None:
        """The blocks of a state group's ``table`` that hold the state after ``start``
        tokens (-1: none yet) and receive the state after ``end``: under prefix caching the
        block of the state's last token (a table entry per block), else its only block."""
        last = len(table) - 1
        bs = self.block_size
        read.append(table[min((start - 1) // bs, last)] if start else -1)
        write.append(table[min((end - 1) // bs, last)])

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run this rank's part of ``out``; on rank 0, the sampled tokens.

        A request samples when this step computes its last known token: the end of its
        prompt (or of its recomputed tokens after preemption), or a decode. Partial prefill
        chunks only fill the cache.
        """
        self.update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        input_ids, positions, metadata, rows, ids = self.prepare_inputs(out)
        links = self.links
        if links is None and self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            hidden = self.cuda_graphs.run(input_ids, positions, metadata)
        elif links is None:
            hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        else:
            hidden_in = links.receive_hidden(len(input_ids))
            hidden = self.model(input_ids, positions, metadata, self.kv_caches,
                                hidden_states=hidden_in)
            if links.send_hidden(hidden):
                hidden = None  # a later stage computes the logits
        tokens = None
        result = ModelRunnerOutput()
        if hidden is not None and links is None:  # logprobs: a single-process engine only
            result.prompt_logprobs = self._prompt_logprobs(out, hidden, result.failures)
        if hidden is not None and rows:
            index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
            logits = self.model.compute_logits(hidden[index])  # tp ranks: an all-gather
            if self.samples:
                tokens = self._sample(logits, ids, result.failures)
                if links is None:
                    result.logprobs = self._logprobs(logits, ids, tokens, result.failures)
        if links is not None and rows:
            tokens = links.gather_tokens(tokens, len(rows))
        if tokens:
            for rid, token in zip(ids, tokens, strict=True):
                if token == FAILED:  # its error is known where it was sampled
                    result.failures.setdefault(rid, RequestFailure(
                        "sampling", "the request failed in sampling (on the sampling rank; "
                        "its log has the cause)"))
                elif rid not in result.failures:
                    result.sampled_token_ids[rid] = token
        return result

    def _sample(self, logits: torch.Tensor, request_ids: list[str],
                failures: dict[str, RequestFailure]) -> list[int]:
        """One token per row; a row whose request failed gets ``FAILED`` (and its failure)."""
        states = [self.requests[rid] for rid in request_ids]
        params = [s.sampling_params for s in states]
        generators = [self._generator(rid, p.seed)
                      for rid, p in zip(request_ids, params, strict=True)]
        # only penalties read the histories: no per-step copy of every context otherwise
        histories = [(s.token_ids[:s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens:])
                     if s.sampling_params.has_penalties else ((), ()) for s in states]
        samples = self.sampler(logits, params, generators, histories,
                               [s.min_tokens_ban() for s in states])
        for row, exc in samples.failures.items():
            failures[request_ids[row]] = _logged(request_ids[row], exc)
        return samples.token_ids

    def _logprobs(self, logits: torch.Tensor, request_ids: list[str], tokens: list[int],
                  failures: dict[str, RequestFailure]) -> dict[str, PositionLogprobs]:
        """The sampled tokens' logprobs, for the requests that asked (and did not fail)."""
        wanted = [i for i, rid in enumerate(request_ids)
                  if self.requests[rid].sampling_params.logprobs is not None
                  and rid not in failures]
        if not wanted:
            return {}

        def compute(rows: list[int]) -> list[PositionLogprobs]:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            return position_logprobs(
                logits[index], [tokens[i] for i in rows],
                [self.requests[request_ids[i]].sampling_params.logprobs for i in rows])

        found = _each_alone(compute, wanted, [request_ids[i] for i in wanted], failures)
        return {request_ids[i]: entry for i, entry in zip(wanted, found, strict=True)
                if entry is not None}

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor,
                         failures: dict[str, RequestFailure]
                         ) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """The logprobs of the prompt tokens this step's rows predict (position p's logits
        score prompt token p + 1), for the requests that asked."""
        rows: dict[str, list[int]] = {}  # request id -> its rows, one per position scored
        spans: dict[str, int] = {}  # request id -> its first position scored
        start_row = 0
        for rid, num_new in out.num_scheduled_tokens.items():
            state = self.requests[rid]
            start = state.num_computed_tokens
            end = min(start + num_new, state.num_prompt_tokens - 1)
            if state.sampling_params.prompt_logprobs is not None and end > start:
                spans[rid] = start
                rows[rid] = [start_row + pos - start for pos in range(start, end)]
            start_row += num_new
        if not rows:
            return {}

        def compute(rids: list[str]) -> list[list[PositionLogprobs]]:
            flat = [row for rid in rids for row in rows[rid]]
            index = torch.tensor(flat, dtype=torch.long, device=hidden.device)
            targets = [self.requests[rid].token_ids[spans[rid] + 1 + k]
                       for rid in rids for k in range(len(rows[rid]))]
            num_top = [self.requests[rid].sampling_params.prompt_logprobs
                       for rid in rids for _ in rows[rid]]
            found = position_logprobs(self.model.compute_logits(hidden[index]), targets, num_top)
            result, i = [], 0
            for rid in rids:
                result.append(found[i:i + len(rows[rid])])
                i += len(rows[rid])
            return result

        rids = list(rows)
        found = _each_alone(compute, rids, rids, failures)
        return {rid: (spans[rid], entries) for rid, entries in zip(rids, found, strict=True)
                if entries is not None}

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int) -> None:
        """A forward pass over ``num_tokens`` prompt tokens that writes no KV (peak activations);
        a later pipeline stage starts from zero hidden states, only the last computes logits.

        The tokens form sequences of at most ``max_model_len``; their block tables point at
        the null block and their slot mappings are -1, so the cache is left untouched.
        """
        query_lens = []
        remaining = num_tokens
        while remaining > 0:
            query_lens.append(min(remaining, max_model_len))
            remaining -= query_lens[-1]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        width = -(-max(query_lens) // self.block_size)
        table = torch.zeros((len(query_lens), width), dtype=torch.int32, device=self.device)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=self.device),
            max_query_len=max(query_lens), max_seq_len=max(query_lens),
            block_tables=[table] * len(self.attention_groups),
            slot_mappings=[torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)]
            * len(self.attention_groups),
            block_size=self.block_size)
        positions = torch.cat([torch.arange(q, device=self.device) for q in query_lens])
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden_in = None
        if not getattr(self.model, "is_first", True):  # a later pipeline stage's input
            hidden_in = torch.zeros((num_tokens, int(self.model.config["hidden_size"])),
                                    dtype=next(self.model.parameters()).dtype,
                                    device=self.device)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches,
                            hidden_states=hidden_in)
        if getattr(self.model, "is_last", True):
            self.model.compute_logits(hidden[-min(len(query_lens), 256):])


def _logged(request_id: str, exc: RequestFailed) -> RequestFailure:
    logger.error("request %s: %s", request_id, exc, exc_info=exc.__cause__ or exc)
    return exc.failure


def _each_alone(compute: Callable[[list[K]], list[T]], keys: list[K], request_ids: list[str],
                failures: dict[str, RequestFailure]) -> list[T | None]:
    """``compute(keys)`` for all at once; if that fails, for each key alone, so that only the
    requests whose own logprobs fail (None, their failure recorded) lose them."""
    try:
        return compute(keys)
    except Exception:  # noqa: BLE001 - find which requests it was, one by one
        pass
    results: list[T | None] = []
    for key, rid in zip(keys, request_ids, strict=True):
        try:
            with request_stage("logprobs"):
                results.append(compute([key])[0])
        except RequestFailed as exc:
            failures[rid] = _logged(rid, exc)
            results.append(None)
    return results
