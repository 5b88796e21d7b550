"""vLLM's attention backends on NVIDIA GPUs, as far as they decide the KV block size.

vLLM 0.32 and 0.33 pick an attention backend per layer (``--attention-backend``, else the
first that takes the model on the GPU: ``vllm/platforms/cuda.py``,
``_get_backend_priorities``), then fit the block size to the backends' kernels
(``Platform.update_block_size_for_backend``):

- each backend lists the kernel block sizes it takes
  (``get_supported_kernel_block_sizes``): an exact size or ``MultipleOf(n)``; a block
  size is taken when it is a multiple of one of them (``supports_block_size``: blocks
  larger than a kernel's are split into kernel blocks);
- without ``--block-size``, the block size is 16 when every backend takes it, else the
  one backend's smallest size, else the smallest lcm of one size per backend that all
  take (``_preferred_block_size_for_backends``; vLLM logs "Setting kv cache block size
  to N for B backend(s)");
- a hybrid's raise (``kvmem.plan.vllm_mamba``) aligns to the first backend's smallest
  size and rounds up to the lcm of every backend's smallest size.

Only the backends' sizes and the rules that select them are kept here, as read from both
releases' code (the same in both, but for 0.33's FA4 sparse MLA backend). Backends that
differ only where block sizes do not (FlashInfer's TRT-LLM pages beside its 16, for
instance) are kept with the sizes that decide. docs/plan.md, "Attention backends".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from itertools import product
from math import lcm

from kvmem.errors import ConfigError
from kvmem.plan.vllm_release import VllmRelease
from kvmem.spec import AttentionKind, ModelSpec

DEFAULT_BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE
HOPPER = 9  # the GPU assumed when none is named
FA4_HD256_PAGE_SIZE = 128  # vllm/v1/attention/backends/fa_utils.py
FLASHINFER_MLA_NOPE_DIMS = (64, 128, 192)  # FlashInferMLABackend.supports_combination
V32_INDEXER = "DEEPSEEK_V32_INDEXER"  # DeepseekV32IndexerBackend: [64] on CUDA


@dataclass(frozen=True)
class Backend:
    """One backend: its kernel block sizes (bases: an exact size or a ``MultipleOf``
    both take the multiples of theirs) and where it runs."""

    name: str
    sizes: tuple[int, ...]
    mla: bool = False
    sparse: bool = False
    majors: tuple[int, ...] | None = None  # compute capability majors (None: any)
    bf16_kv_only: bool = False  # no quantized (fp8) KV cache
    since: tuple[int, int] = (0, 32)

    def takes(self, block_size: int) -> bool:
        return any(block_size % s == 0 for s in self.sizes)


_BACKENDS = (
    Backend("FLASH_ATTN", (16,)),  # FA4's head-256 kernel on Blackwell: see select()
    Backend("FLASHINFER", (16, 32, 64)),
    Backend("TRITON_ATTN", (16,)),
    Backend("FLEX_ATTENTION", (16,)),
    Backend("FLASH_ATTN_MLA", (16,), mla=True, majors=(9,), bf16_kv_only=True),
    Backend("FLASHMLA", (64,), mla=True, majors=(9, 10)),
    Backend("FLASHINFER_MLA", (32, 64), mla=True, majors=(10,)),
    Backend("TOKENSPEED_MLA", (32, 64), mla=True, majors=(10,)),
    Backend("CUTLASS_MLA", (128,), mla=True, majors=(10,)),
    Backend("TRITON_MLA", (16,), mla=True),
    Backend("FLASH_ATTN_MLA_SPARSE_FA4", (64,), mla=True, sparse=True, majors=(10,),
            since=(0, 33)),
    Backend("FLASH_ATTN_MLA_SPARSE", (64,), mla=True, sparse=True, majors=(9,)),
    Backend("FLASHMLA_SPARSE", (64,), mla=True, sparse=True, majors=(9, 10)),
    Backend("FLASHINFER_MLA_SPARSE", (32,), mla=True, sparse=True, majors=(10,)),
    Backend("FLASHINFER_MLA_SPARSE_SM90", (64,), mla=True, sparse=True, majors=(9,)),
    Backend("FLASHINFER_MLA_SPARSE_SM120", (64,), mla=True, sparse=True, majors=(12,)),
)
BACKENDS = {b.name: b for b in _BACKENDS}
INDEXER = Backend(V32_INDEXER, (64,))
# chosen by hand only: the default order never reaches them (TOKENSPEED_MLA needs a
# package vLLM does not install)
NOT_BY_DEFAULT = ("TOKENSPEED_MLA",)


def _priorities(mla: bool, sparse: bool, major: int, quantized_kv: bool,
                heads_per_rank: int) -> list[str]:
    """``_get_backend_priorities`` of vllm/platforms/cuda.py, for causal text models."""
    if not mla:
        if major == 10:
            return ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
        return ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]
    if sparse:
        if major == 10:
            if quantized_kv:
                return ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
            if heads_per_rank <= 16:
                return ["FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE",
                        "FLASHMLA_SPARSE"]
            return ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
        if major == 12:
            return ["FLASHINFER_MLA_SPARSE_SM120"]
        return ["FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"]
    if major == 10:
        return ["FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA",
                "FLASHMLA", "TRITON_MLA"]
    if major == 12:
        return ["TRITON_MLA"]
    return ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA"]


@dataclass(frozen=True)
class AttentionBackends:
    """The distinct backends of a model's attention layers, in layer order."""

    backends: tuple[Backend, ...]
    chosen: bool  # named with --attention-backend

    @property
    def names(self) -> str:
        return "/".join(b.name for b in self.backends)

    def preferred_block_size(self) -> int:
        """The block size without ``--block-size``."""
        bs = self.backends
        if all(b.takes(DEFAULT_BLOCK_SIZE) for b in bs):
            return DEFAULT_BLOCK_SIZE
        # every backend takes a multiple of one of its sizes, so each lcm is taken by all
        # (for one backend: its smallest size, as get_preferred_block_size gives)
        return min(lcm(*sizes) for sizes in product(*(b.sizes for b in bs)))

    @property
    def first_kernel_block(self) -> int:
        """What a hybrid's raise aligns to: the first backend's smallest size."""
        return min(self.backends[0].sizes)

    @property
    def common_kernel_block(self) -> int:
        """What a hybrid's raise rounds up to: the lcm of every backend's smallest size."""
        return reduce(lcm, (min(b.sizes) for b in self.backends))


def select(spec: ModelSpec, release: VllmRelease, *, major: int | None, tp: int,
           quantized_kv: bool, block_size: int | None,
           name: str | None = None) -> AttentionBackends:
    """The backends vLLM ``release`` runs ``spec``'s attention layers on, on a GPU of
    compute capability ``major`` with ``block_size`` (the one given, else None). An
    unknown GPU (None) gets a Hopper's choice, a backend named is taken to run there,
    and where no Hopper backend takes the block size none is returned (the block size
    stands as given: vLLM may run it on a GPU kvmem was not told of)."""
    attention = [lay for lay in spec.layers if lay.has_own_cache]
    if not attention:
        return AttentionBackends((), chosen=name is not None)
    mla = any(lay.kind is AttentionKind.MLA for lay in attention)
    sparse = any(lay.sparse for lay in attention)
    extra = (INDEXER,) if sparse else ()
    if name is not None:
        backend = _named(name, release, mla=mla, sparse=sparse, major=major,
                         quantized_kv=quantized_kv)
        backend = _fa4(backend, spec, major, quantized_kv, block_size)
        if block_size is not None and not backend.takes(block_size):
            raise ConfigError(f"--attention-backend {name}: vLLM's {name} does not take "
                              f"--block-size {block_size} (it takes multiples of "
                              f"{min(backend.sizes)})")
        return AttentionBackends((backend, *extra), chosen=True)
    heads = max(1, spec.num_attention_heads // tp)
    known, major = major is not None, HOPPER if major is None else major
    for candidate in _priorities(mla, sparse, major, quantized_kv, heads):
        backend = BACKENDS[candidate]
        if (candidate in NOT_BY_DEFAULT or not _runs(backend, release, major, quantized_kv)
                or candidate == "FLASHINFER_MLA" and not _flashinfer_mla_shape(spec)
                or block_size is not None and not backend.takes(block_size)):
            continue
        return AttentionBackends((_fa4(backend, spec, major, quantized_kv, block_size),
                                  *extra), chosen=False)
    if not known:  # a block size vLLM runs elsewhere (another GPU, a plugin's engine)
        return AttentionBackends((), chosen=False)
    size = f" with blocks of {block_size}" if block_size is not None else ""
    raise ConfigError(f"vLLM {release.name} has no attention backend for this model on a "
                      f"GPU of compute capability {major}.x{size}")


def _runs(backend: Backend, release: VllmRelease, major: int | None,
          quantized_kv: bool) -> bool:
    return (release.since(*backend.since)
            and (backend.majors is None or major is None or major in backend.majors)
            and not (quantized_kv and backend.bf16_kv_only))


def _named(name: str, release: VllmRelease, *, mla: bool, sparse: bool, major: int | None,
           quantized_kv: bool) -> Backend:
    key = name.strip().upper()
    backend = BACKENDS.get(key)
    if backend is None or not release.since(*backend.since):
        known = ", ".join(n for n, b in BACKENDS.items() if release.since(*b.since))
        raise ConfigError(f"--attention-backend {name}: not one of vLLM {release.name}'s "
                          f"CUDA attention backends kvmem knows ({known})")
    kind = "a sparse MLA" if sparse else "an MLA" if mla else "an attention"
    if backend.mla != mla or backend.sparse != sparse:
        raise ConfigError(f"--attention-backend {key}: this model's layers need {kind} "
                          f"backend, and {key} is {'an MLA' if backend.mla else 'not an MLA'}"
                          f"{' sparse' if backend.sparse else ''} backend")
    if not _runs(backend, release, major, quantized_kv):
        where = (f"on a GPU of compute capability {major}.x"
                 if backend.majors and major is not None and major not in backend.majors
                 else "with an fp8 KV cache")
        raise ConfigError(f"--attention-backend {key}: vLLM does not run it {where}")
    return backend


def _flashinfer_mla_shape(spec: ModelSpec) -> bool:
    return spec.mla is not None and spec.mla.qk_nope_head_dim in FLASHINFER_MLA_NOPE_DIMS


def _fa4(backend: Backend, spec: ModelSpec, major: int | None, quantized_kv: bool,
         block_size: int | None) -> Backend:
    """FlashAttention on Blackwell runs FA4, whose head-256 kernel takes pages of 128
    tokens, unless the model falls back to FA2 (``_fa4_hd256_fallback_reason``)."""
    if backend.name != "FLASH_ATTN" or major != 10:
        return backend
    heads = {lay.head_dim for lay in spec.layers if lay.has_own_cache}
    config = spec.extra.get("config", {}) if isinstance(spec.extra, dict) else {}
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    fallback = (spec.model_type == "gpt_oss"  # attention sinks
                or bool(isinstance(text, dict) and text.get("attn_logit_softcapping"))
                or quantized_kv
                or block_size is not None and block_size % FA4_HD256_PAGE_SIZE)
    if heads != {256} or fallback:
        return backend
    return Backend("FLASH_ATTN", (FA4_HD256_PAGE_SIZE,))
