"""vLLM's rules for linear-attention states (Mamba2, Gated DeltaNet): pages, block size,
charges. Imports no torch.

Read in vLLM 0.32's and 0.33's source; ``kvmem.plan.vllm_rules`` applies them:

- **the state page** (``MambaSpec.page_size_bytes``): the bytes of one layer's state
  tensors on a rank, shaped by ``MambaStateShapeCalculator`` (``kvmem.spec.LinearState``),
  the conv state in ``mamba_cache_dtype`` (``auto``: the model's dtype) and the temporal
  state in ``mamba_ssm_cache_dtype`` (``auto``: the conv's, except where the model's
  config class sets it: Nemotron-H float32, Qwen3.5 its ``mamba_ssm_dtype``; on vLLM's CPU
  platform, on a CPU with AVX512-BF16, float32, see ``state_dtype_bytes``). The KV cache
  dtype (fp8) does not apply to states.
- **the attention block size** (``Platform._align_hybrid_block_size``): raised to the
  smallest multiple of the attention kernel's block (16 for FlashAttention on GPUs, 32 for
  vLLM's CPU attention; at least ``--block-size``) whose attention page (block size x the
  attention layer's bytes per token) holds one state; then the state page is padded to
  that attention page (``mamba_page_size_padded``), so every layer's page is the same.
- **prefix caching** (``MambaModelConfig.verify_and_update_config``): on (vLLM's default
  for generative models) it sets ``mamba_cache_mode="align"`` and the state block size to
  the attention block size; off, ``"none"`` and max_model_len.
- **the per-request charge** (``MambaSpec.max_memory_usage_bytes``): one state page per
  linear group and request with ``"none"``; with ``"align"`` two, plus one checkpoint
  block where the layer exports prefill checkpoints (``num_prefill_checkpoint_blocks``):
  Mamba2 layers always (0.32 and 0.33), Gated DeltaNet layers from 0.33 when their
  prefill runs on FlashInfer (CUDA; not vLLM's CPU platform), which also aligns the block
  size to 64 tokens. Kimi Delta Attention layers export one where their prefill runs on
  FlashKDA (0.32 and 0.33: CUDA SM90/SM10x/SM12x, a bounded gate, head_dim 128; kvmem
  takes a bounded gate on a GPU as FlashKDA), else none. Plus one page per speculative
  token.
- **MLA hybrids** (Kimi Linear): the attention block size is a multiple of 128 tokens
  (``model_config.use_mla`` in ``_align_hybrid_block_size``, 0.32 and 0.33), for the
  MLA decode kernels.
- The groups (``_get_kv_cache_groups_uniform_page_size``) treat the state layers as one
  more kind: every kind is split into groups of the smallest kind's layer count.
- **ReplaySSM** (``--use-replayssm``, 0.32 and 0.33, Nemotron-H only: ``SupportsReplaySSM``):
  each Mamba2 layer's state gains a ring of its last ``--replayssm-buffer-len`` inputs
  (``append_replayssm_ring``: x (heads, ring, head_dim) and B (groups, ring, state size) in
  the model's dtype, dt (heads, ring) in float32, split across ranks like the state; where
  tp does not divide the groups, 0.33 repeats them as the conv state does and 0.32 fails
  at start, which kvmem refuses); FlashInfer's ring is one verify window
  longer (1 + speculative tokens). The layers then hold no per-draft-token state pages
  (``num_speculative_blocks`` 0). ``VllmConfig.validate_mamba_cached_kernel``'s refusals
  are kvmem's: FlashInfer takes a ring of at most 16 and no prefix caching; speculative
  decoding needs FlashInfer, without prefix caching.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import ceil, lcm
from pathlib import Path

from kvmem.errors import ConfigError
from kvmem.plan.vllm_release import VllmRelease
from kvmem.spec import AttentionKind, ModelSpec, dtype_bytes
from kvmem.spec.layout import LinearState, StateKind

MAMBA = "mamba"
KERNEL_BLOCK = {"gpu": 16, "cpu": 32}  # FlashAttention MultipleOf(16); CPU MultipleOf(32)
MLA_HYBRID_BLOCK_ALIGNMENT = 128  # vllm/platforms/interface.py, model_config.use_mla
KDA_SSM_DTYPES = ("auto", "float32", "bfloat16")  # MambaStateDtypeCalculator.kda_state_dtype
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64  # vllm/v1/attention/backends/gdn_attn.py (0.33)


@dataclass(frozen=True)
class MambaRules:
    """How vLLM pages one model's linear-attention states on a rank."""

    cache_mode: str  # "align" (prefix caching) or "none"
    state_bytes: int  # one layer's state on a rank, unpadded
    block_size: int  # the attention block size, raised to hold a state page
    page: int  # the state page, padded to the attention page
    charge: int  # pages one request holds in each linear group

    @property
    def padding(self) -> float:
        """How much the state page is padded, as vLLM logs it (percent)."""
        return 100 * (self.page - self.state_bytes) / self.state_bytes


@functools.cache
def _cpu_flag(name: str) -> bool:
    """Whether this host's CPU lists ``name`` among its flags in /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith("flags") and name in line.split() for line in lines)


def cpu_avx512_bf16() -> bool:
    """Whether this host's CPU has AVX512-BF16, as vLLM's CPU platform asks before it
    moves SSM states to float32 for its accelerated Gated DeltaNet (AMD Zen 3 has not)."""
    return _cpu_flag("avx512_bf16")


def cpu_amx_tiles() -> bool:
    """Whether this host's CPU has AMX tiles, where vLLM's CPU platform runs MLA on its
    AMX kernel rather than the reference one (``torch.cpu._is_amx_tile_supported``)."""
    return _cpu_flag("amx_tile")


def state_dtype_bytes(state: LinearState, model_dtype: str, mamba_cache_dtype: str,
                      mamba_ssm_cache_dtype: str, device: str,
                      avx512_bf16: bool | None = None) -> tuple[int, int]:
    """(conv, ssm) bytes per element (``MambaStateDtypeCalculator``). On vLLM's CPU
    platform, where the CPU has AVX512-BF16 (``avx512_bf16``; None: this host's, taken
    to be the one that serves), an SSM state not float32 becomes float32, except a
    Gated DeltaNet state in float16 or bfloat16 (``CpuPlatform.check_and_update_config``);
    on other CPUs it stays as the model family sets it."""
    if state.kind is StateKind.KDA and mamba_ssm_cache_dtype not in KDA_SSM_DTYPES:
        raise ConfigError("Kimi Delta Attention's recurrent state is auto, float32 or "
                          f"bfloat16 in vLLM, not --mamba-ssm-cache-dtype "
                          f"{mamba_ssm_cache_dtype}")
    conv_dtype = model_dtype if mamba_cache_dtype == "auto" else mamba_cache_dtype
    ssm_dtype = (mamba_ssm_cache_dtype if mamba_ssm_cache_dtype != "auto"
                 else state.ssm_dtype or "auto")
    if avx512_bf16 is None:
        avx512_bf16 = device == "cpu" and cpu_avx512_bf16()
    if device == "cpu" and avx512_bf16 and not (
            state.kind is StateKind.GATED_DELTA_NET and ssm_dtype in ("float16", "bfloat16")):
        ssm_dtype = "float32"
    return dtype_bytes(conv_dtype), dtype_bytes(conv_dtype if ssm_dtype == "auto"
                                                else ssm_dtype)


def checkpoint_blocks(state: LinearState, release: VllmRelease, device: str) -> int:
    """``MambaSpec.num_prefill_checkpoint_blocks`` of the model's state layers."""
    if state.kind is StateKind.MAMBA2:
        return 1
    if state.kind is StateKind.GATED_DELTA_NET and release.gdn_prefill_checkpoints:
        return int(device == "gpu")
    if state.kind is StateKind.KDA and state.temporal is not None:
        return int(device == "gpu" and state.bounded_gate and state.temporal[1] == 128)
    return 0


REPLAYSSM_ARCHITECTURES = ("NemotronHForCausalLM",)  # SupportsReplaySSM in 0.33
FLASHINFER_REPLAYSSM_MAX_RING = 16


def replayssm_ring_bytes(spec: ModelSpec, state: LinearState, release: VllmRelease, *,
                         tp: int, buffer_len: int, backend: str, prefix_caching: bool,
                         num_spec: int) -> int:
    """The bytes ``--use-replayssm`` adds to one Mamba2 layer's state on a rank, after
    vLLM's checks of the flags (see the module docstring)."""
    if not release.replayssm:
        raise ConfigError(f"--use-replayssm: kvmem knows vLLM's ReplaySSM from 0.32, not in "
                          f"{release.name}")
    if spec.architecture not in REPLAYSSM_ARCHITECTURES or state.kind is not StateKind.MAMBA2:
        raise ConfigError(f"--use-replayssm is not supported for architecture "
                          f"{spec.architecture!r} (vLLM: {', '.join(REPLAYSSM_ARCHITECTURES)})")
    if buffer_len < 1:
        raise ConfigError(f"--replayssm-buffer-len must be positive, got {buffer_len}")
    flashinfer = backend == "flashinfer"
    if flashinfer and buffer_len > FLASHINFER_REPLAYSSM_MAX_RING:
        raise ConfigError("FlashInfer ReplaySSM takes --replayssm-buffer-len of at most "
                          f"{FLASHINFER_REPLAYSSM_MAX_RING}, got {buffer_len}")
    if (flashinfer or num_spec) and prefix_caching:
        raise ConfigError(f"{'FlashInfer ' if flashinfer else ''}ReplaySSM"
                          f"{' speculative decoding' if num_spec else ''} does not support "
                          "prefix caching in vLLM; add --no-enable-prefix-caching")
    if num_spec and not flashinfer:
        raise ConfigError("Mamba2 ReplaySSM speculative decoding needs --mamba-backend "
                          "flashinfer")
    assert state.temporal is not None
    heads, head_dim, state_size = state.temporal
    groups = state.n_groups
    if groups % tp and not release.replayssm_repeats_groups:
        raise ConfigError(f"vLLM {release.name}'s ReplaySSM cannot split the model's "
                          f"{groups} Mamba2 groups across tensor parallel size {tp}")
    if groups % tp:
        groups = tp  # repeated on each rank, as the conv state repeats them
    ring = buffer_len + (1 + num_spec if flashinfer else 0)
    act = dtype_bytes(spec.dtype)
    local_heads, local_groups = heads // tp, groups // tp
    return ring * (local_heads * head_dim * act + local_heads * 4
                   + local_groups * state_size * act)


def mamba_rules(spec: ModelSpec, release: VllmRelease, *, tp: int, kv_dtype_bytes: int,
                block_size: int, device: str, prefix_caching: bool,
                mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto",
                num_spec: int = 0, cpu_avx512_bf16: bool | None = None,
                replayssm_buffer_len: int | None = None, mamba_backend: str = "triton",
                kernel_blocks: tuple[int, int] | None = None) -> MambaRules | None:
    """vLLM's paging of ``spec``'s states (None: the model has no linear-attention layer);
    ``replayssm_buffer_len``: ``--use-replayssm`` with that ring (None: off);
    ``kernel_blocks``: the attention backends' first and common kernel blocks
    (``kvmem.plan.vllm_backends``; None: ``KERNEL_BLOCK`` of the device)."""
    states = {lay.state for lay in spec.layers if lay.kind is AttentionKind.LINEAR}
    if not states:
        return None
    if None in states:
        raise ConfigError(f"{spec.name}: kvmem does not know the state of its "
                          "linear-attention layers (model type "
                          f"{spec.model_type or 'unknown'})")
    if len(states) > 1:
        raise ConfigError(f"{spec.name}: linear-attention layers with different states "
                          "are not planned")
    state, = states
    conv, ssm = state_dtype_bytes(state, spec.dtype, mamba_cache_dtype, mamba_ssm_cache_dtype,
                                  device, cpu_avx512_bf16)
    raw = state.bytes(tp, conv, ssm, num_spec)
    spec_blocks = num_spec
    if replayssm_buffer_len is not None:
        raw += replayssm_ring_bytes(spec, state, release, tp=tp,
                                    buffer_len=replayssm_buffer_len, backend=mamba_backend,
                                    prefix_caching=prefix_caching, num_spec=num_spec)
        spec_blocks = 0  # the window is verified off one checkpoint
    mode = "align" if prefix_caching else "none"
    checkpoints = checkpoint_blocks(state, release, device)
    charge = (2 + checkpoints if mode == "align" else 1) + spec_blocks
    per_token = max((lay.bytes_per_token(tp, kv_dtype_bytes) for lay in spec.layers
                     if lay.kind.uses_blocks), default=0)
    if not per_token:  # attention-free: no attention page to match
        return MambaRules(mode, raw, block_size, raw, charge)
    first, kernel = kernel_blocks or (KERNEL_BLOCK.get(device, KERNEL_BLOCK["gpu"]),) * 2
    align = max(first, block_size)
    if any(lay.kind is AttentionKind.MLA for lay in spec.layers):
        align = max(align, MLA_HYBRID_BLOCK_ALIGNMENT)
    if mode == "align" and checkpoints and state.kind is StateKind.GATED_DELTA_NET:
        align = lcm(align, FLASHINFER_GDN_CHECKPOINT_ALIGNMENT)
    needed = align * ceil(raw / (align * per_token))
    needed = kernel * ceil(needed / kernel)
    block = max(block_size, needed)
    return MambaRules(mode, raw, block, block * per_token, charge)
