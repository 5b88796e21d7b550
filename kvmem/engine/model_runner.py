"""ModelRunner: turns a scheduled batch into model inputs, runs the model, samples tokens.

All sequences of a step are packed into one flat token dimension; each sequence brings
its block table per KV group, and the slot of every new token is derived from it.
"""

from __future__ import annotations

import torch

from kvmem.engine.attention.metadata import AttentionMetadata
from kvmem.engine.logprobs import position_logprobs
from kvmem.engine.request import Request
from kvmem.engine.sampler import Sampler


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], kv_cache_manager,
                 *, num_kv_groups: int, block_size: int, device: torch.device,
                 sampler: Sampler) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_cache_manager = kv_cache_manager
        self.num_kv_groups = num_kv_groups
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.cuda_graphs = None  # a CUDAGraphRunner once capture_cuda_graphs has run

    def capture_cuda_graphs(self, batch_sizes: list[int], max_model_len: int) -> None:
        """Capture the decode forward for ``batch_sizes`` over this runner's KV cache (GPU)."""
        from kvmem.engine.cuda_graphs import CUDAGraphRunner

        graphs = CUDAGraphRunner(self.model, self.kv_caches, num_kv_groups=self.num_kv_groups,
                                 block_size=self.block_size, max_model_len=max_model_len,
                                 batch_sizes=batch_sizes, device=self.device)
        graphs.capture()
        self.cuda_graphs = graphs

    def prepare_inputs(self, scheduled: list[tuple[Request, int]]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens = [], []
        tables: list[list[list[int]]] = [[] for _ in range(self.num_kv_groups)]
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            input_ids.extend(request.all_token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            for group, ids in zip(tables, block_ids, strict=True):
                group.append(list(ids))
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size,
                                           device=self.device)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), metadata)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """Run one step; returns the sampled token of every request that completes its input.

        A request samples when this step computes its last known token: the end of its
        prompt (or of its recomputed tokens after preemption), or a decode. Partial prefill
        chunks only fill the cache. Requests that asked for logprobs get them appended to
        ``request.output_logprobs`` / ``request.prompt_logprobs``.
        """
        input_ids, positions, metadata = self.prepare_inputs(scheduled)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            hidden = self.cuda_graphs.run(input_ids, positions, metadata)
        else:
            hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        samplers: list[Request] = []
        last_indices: list[int] = []
        end = 0
        for request, num_new in scheduled:
            end += num_new
            if request.num_computed_tokens + num_new == request.num_tokens:
                samplers.append(request)
                last_indices.append(end - 1)
        self._prompt_logprobs(scheduled, hidden)
        if not samplers:
            return {}
        index = torch.tensor(last_indices, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden[index])
        tokens = self.sampler(logits, [r.sampling_params for r in samplers],
                              [getattr(r, "generator", None) for r in samplers],
                              [(r.prompt_token_ids, r.output_token_ids) for r in samplers])
        wanted = [i for i, r in enumerate(samplers) if r.sampling_params.logprobs is not None]
        if wanted:
            rows = logits[torch.tensor(wanted, dtype=torch.long, device=logits.device)]
            found = position_logprobs(rows, [tokens[i] for i in wanted],
                                      [samplers[i].sampling_params.logprobs for i in wanted])
            for i, entry in zip(wanted, found, strict=True):
                samplers[i].output_logprobs.append(entry)
        return {r.request_id: t for r, t in zip(samplers, tokens, strict=True)}

    def _prompt_logprobs(self, scheduled: list[tuple[Request, int]], hidden: torch.Tensor
                         ) -> None:
        """Append the logprobs of the prompt tokens this step's rows predict (position p's
        logits score prompt token p + 1), for the requests that asked and lack them."""
        rows: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        owners: list[Request] = []
        start_row = 0
        for request, num_new in scheduled:
            want = request.sampling_params.prompt_logprobs
            if want is not None and request.prompt_logprobs is not None:
                start = request.num_computed_tokens
                first = max(start, len(request.prompt_logprobs) - 1)
                for pos in range(first, min(start + num_new, request.num_prompt_tokens - 1)):
                    rows.append(start_row + pos - start)
                    targets.append(request.prompt_token_ids[pos + 1])
                    num_top.append(want)
                    owners.append(request)
            start_row += num_new
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        found = position_logprobs(self.model.compute_logits(hidden[index]), targets, num_top)
        for request, entry in zip(owners, found, strict=True):
            request.prompt_logprobs.append(entry)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int) -> None:
        """A forward pass over ``num_tokens`` prompt tokens that writes no KV (peak activations).

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
            block_tables=[table] * self.num_kv_groups,
            slot_mappings=[torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)]
            * self.num_kv_groups,
            block_size=self.block_size)
        positions = torch.cat([torch.arange(q, device=self.device) for q in query_lens])
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        self.model.compute_logits(hidden[-min(len(query_lens), 256):])
