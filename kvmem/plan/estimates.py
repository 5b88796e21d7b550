"""Estimates of the non-KV memory a rank needs when nothing was measured.

Calibrated to public vLLM memory profiles (docs/plan.md lists the figures and the errors):

- peak activation: one chunked-prefill step of ``max_num_batched_tokens`` tokens. The last
  pipeline stage holds fp32 logits for every token (tokens x vocab x 4 bytes); every stage
  holds a few hidden-size and intermediate-size buffers per token (and expert routing
  buffers for MoE models);
- CUDA graphs: a constant per captured batch size per decoder layer on the rank, twice as
  much with tensor parallelism (all-reduce nodes and their buffers);
- non-torch memory (CUDA context, communicators): 0.15 GiB alone, 0.5 GiB with parallelism.
"""

from __future__ import annotations

from kvmem.spec import ModelSpec, dtype_bytes
from kvmem.units import GiB, MiB

HIDDEN_BUFFERS = 8  # hidden-size activations alive per token at the peak (residual, qkv, ...)
INTERMEDIATE_BUFFERS = 3  # gate, up and activated intermediate per token
GRAPH_BYTES_PER_LAYER_PER_SIZE = round(0.384 * MiB)
NON_TORCH_SINGLE = round(0.15 * GiB)
NON_TORCH_PARALLEL = round(0.5 * GiB)


def cuda_graph_capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured by default: 1, 2, 4, multiples of 8, then of 16 up to
    min(2 x max_num_seqs, 512)."""
    largest = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return [s for s in sizes if s <= largest]


def activation_bytes(spec: ModelSpec, tp: int, max_num_batched_tokens: int,
                     is_last_stage: bool) -> int:
    """Peak activation memory of one rank during a step of max_num_batched_tokens tokens."""
    elem = dtype_bytes(spec.dtype)
    moe = spec.moe
    inter = moe.moe_intermediate_size if moe else spec.intermediate_size
    per_token = elem * (HIDDEN_BUFFERS * spec.hidden_size + INTERMEDIATE_BUFFERS * inter // tp)
    if moe:  # routed copies of each token's hidden state and expert intermediates
        per_token += elem * moe.experts_per_token * (spec.hidden_size + 3 * inter // tp)
    if is_last_stage:
        per_token += 4 * spec.vocab_size  # fp32 logits, gathered over tensor-parallel ranks
    return max_num_batched_tokens * per_token


def cuda_graph_bytes(num_layers_on_rank: int, tp: int, max_num_seqs: int) -> int:
    per = GRAPH_BYTES_PER_LAYER_PER_SIZE * (2 if tp > 1 else 1)
    return num_layers_on_rank * len(cuda_graph_capture_sizes(max_num_seqs)) * per


def non_torch_bytes(tp: int, pp: int) -> int:
    return NON_TORCH_PARALLEL if tp * pp > 1 else NON_TORCH_SINGLE
