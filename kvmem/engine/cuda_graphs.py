"""CUDA graphs of the decode forward: capture once per batch size, replay every decode step.

A decode step launches the same kernels every time, only its inputs differ, so the model's
forward for a batch of B one-token sequences is recorded once into a ``torch.cuda.CUDAGraph``
whose inputs are static buffers (token ids, positions, sequence lengths, block tables, slot
mappings). A step copies its inputs into the first rows of those buffers, pads the rest
(sequence length 1 over the null block, slot -1 so nothing is written) and replays the
graph of the smallest captured size that holds it. Logits and sampling stay eager.

All graphs share one memory pool; its size is the "CUDA graphs" figure of a memory profile
and must be set aside before the KV cache is sized (kvmem.engine.profiler).
"""

from __future__ import annotations

import torch

from kvmem.engine.attention.metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The planner's capture sizes (1, 2, 4, 8, 16, ...) up to the first that holds
    max_num_seqs: a decode batch never has more sequences than that."""
    from kvmem.plan.estimates import cuda_graph_capture_sizes

    sizes = cuda_graph_capture_sizes(max(max_num_seqs, 256))
    covering = next((s for s in sizes if s >= max_num_seqs), sizes[-1])
    return [s for s in sizes if s <= covering]


class CUDAGraphRunner:
    """Captured decode forwards of ``model`` over ``kv_caches`` for ``batch_sizes``."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], *,
                 num_kv_groups: int, block_size: int, max_model_len: int,
                 batch_sizes: list[int], device: torch.device) -> None:
        if not batch_sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(set(batch_sizes))
        self.device = device
        largest = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros((largest, max_blocks), dtype=torch.int32, device=device)
                             for _ in range(num_kv_groups)]
        self.slot_mappings = [torch.full((largest,), -1, dtype=torch.int64, device=device)
                              for _ in range(num_kv_groups)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, batch: int) -> AttentionMetadata:
        # host-side lists are given so that building the metadata never reads the device
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            max_query_len=1, max_seq_len=self.max_model_len,
            block_tables=[t[:batch] for t in self.block_tables],
            slot_mappings=[s[:batch] for s in self.slot_mappings], block_size=self.block_size,
            query_lens=[1] * batch, seq_lens_cpu=[self.max_model_len] * batch)

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch], self.positions[:batch], self._metadata(batch),
                          self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, so that smaller graphs reuse its pool."""
        for batch in reversed(self.batch_sizes):
            self._forward(batch)  # warm-up: compiles kernels, settles lazy state
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Drop every graph and its pool (profiling captures on a scratch cache)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (bool(self.graphs) and metadata.is_decode_only
                and 0 < metadata.num_seqs <= self.max_batch_size
                and metadata.max_seq_len <= self.max_model_len
                and all(t.shape[1] <= s.shape[1]
                        for t, s in zip(metadata.block_tables, self.block_tables, strict=True)))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch of n sequences (n = len(input_ids))."""
        n = input_ids.shape[0]
        batch = next(s for s in self.batch_sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:batch].fill_(1)
        for static, table in zip(self.block_tables, metadata.block_tables, strict=True):
            static[:n, :table.shape[1]].copy_(table)
            static[n:batch, 0].zero_()  # padded rows read the null block
        for static, slots in zip(self.slot_mappings, metadata.slot_mappings, strict=True):
            static[:n].copy_(slots)
            static[n:batch].fill_(-1)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
