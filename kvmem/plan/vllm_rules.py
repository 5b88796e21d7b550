"""vLLM's KV cache rules: what vLLM charges, groups and reports, per release.

``VllmGeometry`` answers the planner's questions (``kvmem.plan.geometry.Geometry``) as
the vLLM release in ``kvmem.plan.vllm_release`` does, read in vLLM's own source:

- **layer specs** (``Attention.get_kv_cache_spec`` / the model runner's
  ``get_kv_cache_spec``): full attention ``FullAttentionSpec``, sliding window
  ``SlidingWindowSpec``, chunked local ``ChunkedLocalAttentionSpec``, latent attention
  ``MLAAttentionSpec``. A page (``page_size_bytes``) is block_size x the layer's bytes per
  token on the rank (K and V of its KV heads; MLA one latent). Without the hybrid manager
  (``unify_hybrid_kv_cache_specs``) sliding and chunked layers become full attention.
- **per-request charge** (each spec's ``max_memory_usage_bytes`` / its page): full and MLA
  ``cdiv(max_model_len, block_size)``; sliding window ``cdiv(min(window - 1 + T,
  max_model_len), block_size) + 1`` (the window may start mid-block), chunked local
  ``cdiv(min(chunk + T, max_model_len), block_size)``, where T is
  ``max_num_batched_tokens`` (from 0.26 ``VllmConfig.max_in_flight_tokens``:
  ``max_concurrent_batches`` times it).
- **groups** (``_get_kv_cache_groups_uniform_page_size``; before 0.11
  ``_get_kv_cache_config_uniform_page_size`` per worker): one group when every layer has
  the same spec (or, from 0.11, the same kind: ``UniformTypeKVCacheSpecs``); otherwise each
  kind is split into groups of the group size (the fewest layers of a kind, or the most
  when the ratio rule of ``VllmRelease.group_size_ratio`` applies), the last padded. Group
  i of a kind with n groups takes layers ``[i::n]`` from 0.11, consecutive runs before.
  Groups overlay one another: one tensor per slot, shared by the layer at that slot in
  every group, so a block costs ``max over groups of the pages of the group's layers on
  the rank`` (``get_kv_cache_config_from_groups``, ``_get_kv_cache_bytes_per_block``).
  Under pipeline parallelism a stage keeps its layers of every global group
  (``_project_kv_cache_groups_to_worker``); before 0.11 each stage grouped its own.
- **blocks** per worker ``budget // bytes per block``; the engine takes the smallest.
- **reports**: the maximum concurrency ``blocks / the blocks one request is charged over
  all groups`` (``get_max_concurrency_for_kv_cache_config``) and the KV cache size
  (``update_kv_cache_capacity`` / ``_report_kv_cache_config``): ``int(concurrency x
  max_model_len)`` from 0.20.1, ``blocks // groups x block_size`` before.
- **fit check** (``_check_enough_kv_cache_memory`` with its need, see
  ``VllmRelease.fit_check``).
- **other kinds** (read in 0.32 and 0.33): a layer reading another's KV has no spec; MLA
  with DeepSeek V3.2's indexer is one ``UniformTypeKVCacheSpecs`` group with full attention
  (its page the sum); a speculative draft's layers join on the last stage, and chained MTP
  modules make sliding windows retain ``num_speculative_tokens - 1`` more tokens
  (``extra_retained_tokens``); the lookahead slots never pass max_model_len, so they change
  no charge (``lookahead_tokens``, ``retained_tokens``).

Linear-attention (Mamba2, Gated DeltaNet) layers are ``MambaSpec`` layers: their state
page, the raised attention block size and their charge are ``kvmem.plan.vllm_mamba``'s.
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from math import ceil

from kvmem.errors import ConfigError
from kvmem.plan import vllm_backends
from kvmem.plan.geometry import Geometry, StageKV
from kvmem.plan.vllm_mamba import MAMBA, cpu_amx_tiles, mamba_rules
from kvmem.plan.vllm_release import (
    CHECK_FIRST_GROUP,
    CHECK_GLOBAL,
    CHECK_LAYERS,
    CHECK_NULL_BLOCK,
    VllmRelease,
)
from kvmem.spec import AttentionKind, ModelSpec
from kvmem.spec.layout import Speculative, StateKind

FULL, SLIDING, CHUNKED, MLA = "full", "sliding", "chunked", "mla"


def uniform_type(kind: str) -> str:
    """The kind vLLM's ``UniformTypeKVCacheSpecs`` groups a layer by: latent attention
    (and an MLA model's indexer cache) is full attention (``KVCacheSpecRegistry``:
    ``MLAAttentionSpec``'s ``uniform_type_base_spec`` is ``FullAttentionSpec``)."""
    return FULL if kind == MLA else kind


def default_concurrent_batches(release: VllmRelease, device: str, pp: int) -> int:
    """``VllmConfig.max_concurrent_batches`` as vLLM sets it by default (only used from
    0.26): pp, or 2 with asynchronous scheduling, which is on by default on GPUs and off
    on vLLM's CPU platform (``CpuPlatform.check_and_update_config``). With pipeline
    parallelism the V1 model runner keeps pp (0.31 to 0.33 fall back to it); 0.29 and 0.30
    run it on the V2 model runner, which keeps pp + 1 batches in flight."""
    if device == "cpu":
        return pp
    if pp == 1:
        return 2
    return pp + 1 if release.since(0, 29) and not release.since(0, 31) else pp


EAGLE_FAMILY = ("eagle", "eagle3", "mtp")  # SpeculativeConfig.use_eagle (of kvmem's methods)


def lookahead_tokens(spec: Speculative | None) -> int:
    """``VllmConfig.num_lookahead_tokens``: slots past the scheduled tokens that
    ``allocate_slots`` reserves for the draft (num_speculative_tokens for EAGLE, MTP and a
    draft model; none for n-gram and suffix decoding)."""
    if spec is None or spec.method not in (*EAGLE_FAMILY, "draft_model"):
        return 0
    return spec.num_speculative_tokens


def retained_tokens(spec: Speculative | None) -> int:
    """``SlidingWindowSpec.extra_retained_tokens`` (``get_kv_cache_configs``): the
    prefill lookahead less one. Chained MTP modules (``use_multi_module_mtp``: more than
    one module and token) read num_speculative_tokens ahead, other EAGLE drafts one."""
    if spec is None or spec.method not in EAGLE_FAMILY:
        return 0
    k = spec.num_speculative_tokens
    return k - 1 if spec.method == "mtp" and min(spec.num_mtp_layers, k) > 1 else 0


@dataclass(frozen=True)
class LayerSpec:
    """One layer's KV cache spec as vLLM builds it (the fields that decide its blocks)."""

    kind: str  # FULL, SLIDING, CHUNKED or MLA
    window: int | None  # sliding window or attention chunk size
    page: int  # page_size_bytes at block_size
    block_size: int


@dataclass(frozen=True)
class VllmGroup:
    """A KV cache group: layers of one spec sharing one block table."""

    kind: str
    window: int | None
    block_size: int
    layers: tuple[int, ...]


CPU_MLA_BLOCK = 16  # vLLM's reference CPU MLA decode kernel (csrc/cpu/mla_decode.cpp)
# vllm.models.kimi_k3 loads its NVIDIA classes on every platform but ROCm and TPU: a start
# on the CPU build imports CUTLASS's CuTe DSL (VLLM_KIMI_K3_GEMM_AR, on by default), and
# Kimi Delta Attention's prefill and decode resolve to Triton, which has no CPU backend
KDA_ON_CPU = ("{name}'s CPU build cannot run Kimi Linear (Kimi Delta Attention): it loads "
              "the model's NVIDIA implementation (CUTLASS kernels) and KDA's Triton kernels; "
              "plan it with --device gpu")


def cpu_reference_mla(spec: ModelSpec, amx: bool | None = None) -> bool:
    """Whether vLLM's CPU platform runs ``spec``'s MLA layers on its reference kernel:
    an MLA model (DeepSeek V4 aside, which has kernels of its own) on a CPU without AMX
    tiles (``amx``; None: this host's). It then sets blocks of 16 tokens whatever
    ``--block-size`` says, and turns chunked prefill and prefix caching off
    (``CpuPlatform.check_and_update_config``, 0.32 and 0.33)."""
    if spec.model_type == "deepseek_v4" or not any(
            lay.kind is AttentionKind.MLA for lay in spec.layers):
        return False
    return not (cpu_amx_tiles() if amx is None else amx)


class VllmGeometry(Geometry):
    """vLLM's rules for one model, engine config and release (see the module doc)."""

    def __init__(self, spec: ModelSpec, tp: int, kv_dtype_bytes: int, state_dtype_bytes: int,
                 block_size: int, max_num_batched_tokens: int, *, release: VllmRelease,
                 pp: int = 1, device: str = "gpu", hybrid: bool | None = None,
                 max_concurrent_batches: int | None = None, prefix_caching: bool = True,
                 mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto",
                 cpu_avx512_bf16: bool | None = None, replayssm_buffer_len: int | None = None,
                 mamba_backend: str = "triton", cpu_amx: bool | None = None,
                 attention_backend: str | None = None, gpu_arch: int | None = None,
                 backend_block_size: bool = False) -> None:
        name = f"vLLM {release.name}"
        if device == "cpu" and any(lay.state is not None and lay.state.kind is StateKind.KDA
                                   for lay in spec.layers):
            raise ConfigError(KDA_ON_CPU.format(name=name))
        reference_mla = device == "cpu" and cpu_reference_mla(spec, cpu_amx)
        given_block = block_size
        if reference_mla:  # CpuPlatform.check_and_update_config
            block_size, prefix_caching = CPU_MLA_BLOCK, False
        backends, given = None, not backend_block_size
        if device == "gpu" and release.gpu_backend_block_size:
            backends = vllm_backends.select(
                spec, release, major=gpu_arch, tp=tp,
                quantized_kv=kv_dtype_bytes == 1, name=attention_backend,
                block_size=block_size if given else None)
            if backends.backends and not given:
                block_size = backends.preferred_block_size()
        elif attention_backend is not None:
            raise ConfigError(f"--attention-backend: {name} on "
                              f"{'the CPU' if device == 'cpu' else 'a GPU'} is planned "
                              "without it (kvmem knows vLLM's GPU backends from 0.32)")
        super().__init__(spec, tp, kv_dtype_bytes, state_dtype_bytes, block_size,
                         max_num_batched_tokens)
        self.release = release
        self.name = name
        if reference_mla:
            self.notes.append(
                f"{name}'s CPU platform runs this MLA model on its reference kernel (the CPU "
                f"has no AMX): blocks of {CPU_MLA_BLOCK} tokens"
                f"{f' (not {given_block})' if given_block != CPU_MLA_BLOCK else ''}, prefix "
                "caching and chunked prefill off")
        self.device = device
        if backends is not None and backends.backends:
            self._note_backends(backends, gpu_arch, given)
        self.hybrid = self._hybrid_default() if hybrid is None else hybrid
        self.concurrent_batches = (default_concurrent_batches(release, device, pp)
                                   if max_concurrent_batches is None
                                   else max_concurrent_batches)
        draft = spec.speculative
        if draft is not None and draft.layers:
            n = len(draft.layers)
            self.notes.append(f"the {draft.method} draft's KV layers ({n}) join the last "
                              "stage's (its weights are not in the estimate)")
        self.extra_retained_tokens = retained_tokens(spec.speculative)
        self.lookahead_tokens = lookahead_tokens(spec.speculative)
        if self.lookahead_tokens:
            self.notes.append(f"{self.name} reserves {self.lookahead_tokens} lookahead slots "
                              "per running request for the draft, never past max_model_len: "
                              "the blocks of a request at max_model_len, the concurrency and "
                              "the fit check are those without them")
        self.mamba = mamba_rules(
            spec, release, tp=tp, kv_dtype_bytes=kv_dtype_bytes, block_size=block_size,
            device=device, prefix_caching=prefix_caching, mamba_cache_dtype=mamba_cache_dtype,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, cpu_avx512_bf16=cpu_avx512_bf16,
            num_spec=spec.speculative.num_speculative_tokens if spec.speculative else 0,
            replayssm_buffer_len=replayssm_buffer_len, mamba_backend=mamba_backend,
            kernel_blocks=None if not backends or not backends.backends else
            (backends.first_kernel_block, backends.common_kernel_block))
        if self.mamba is not None and self.mamba.block_size != block_size:
            self.block_size = self.mamba.block_size
            self.notes.append(f"{self.name} raises the attention block size to "
                              f"{self.block_size} tokens so that a page holds one "
                              f"linear-attention state")
        if self.mamba is not None and self.mamba.padding:
            self.notes.append(f"{self.name} pads the state page by {self.mamba.padding:.2f}% "
                              "to the attention page")

    def _note_backends(self, backends: vllm_backends.AttentionBackends, gpu_arch: int | None,
                       given: bool) -> None:
        """Say which backends decide the blocks where it matters: a chosen backend, a
        block size not vLLM's default 16, or an MLA model on a GPU not named."""
        unknown_mla = gpu_arch is None and any(lay.kind is AttentionKind.MLA and not lay.sparse
                                               for lay in self.spec.layers)
        if not (backends.chosen or unknown_mla
                or self.block_size != vllm_backends.DEFAULT_BLOCK_SIZE and not given):
            return
        why = ("--attention-backend" if backends.chosen else
               "its choice for a Hopper GPU: give --gpu, as Blackwell's MLA backends take "
               "larger blocks" if unknown_mla else
               "its choice for a Hopper GPU" if gpu_arch is None else "its choice for this GPU")
        size = "" if given else f", whose kernels take blocks of {self.block_size} tokens"
        self.notes.append(f"{self.name} runs this model's attention on {backends.names} "
                          f"({why}){size}")

    @cached_property
    def layer_state_bytes(self) -> list[int]:
        """vLLM keeps linear-attention states in blocks (``MambaSpec``), nothing apart."""
        return [0] * len(self.layers)

    def _hybrid_default(self) -> bool:
        """Whether vLLM runs its hybrid KV cache manager by default (``VllmConfig``)."""
        r = self.release
        if not r.hybrid_manager or (self.device == "cpu" and not r.cpu_hybrid):
            return False
        chunked = any(lay.kind is AttentionKind.CHUNKED for lay in self.spec.layers)
        return not (chunked and r.chunked_local_disables_hybrid)

    # ------------------------------------------------------------------ layer specs
    @property
    def in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet settled that window charges count."""
        batches = self.concurrent_batches if self.release.in_flight_batches else 1
        return batches * self.max_num_batched_tokens

    def raw_spec(self, i: int) -> LayerSpec | None:
        """Layer i's spec as its attention layer reports it (None: no paged KV)."""
        lay = self.layers[i]
        if lay.kind is AttentionKind.LINEAR and self.mamba is not None:  # MambaSpec
            return LayerSpec(MAMBA, None, self.mamba.page, self.block_size)
        page = self.block_size * self.layer_bytes_per_token[i]
        kind = {AttentionKind.FULL: FULL, AttentionKind.MLA: MLA,
                AttentionKind.SLIDING: SLIDING, AttentionKind.CHUNKED: CHUNKED}.get(lay.kind)
        if kind is None or lay.kv_source is not None:  # a KV-sharing layer has no spec
            return None
        if kind == CHUNKED and not self.release.chunked_local_spec:
            kind = FULL
        return LayerSpec(kind, lay.window if kind in (SLIDING, CHUNKED) else None, page,
                         self.block_size)

    @cached_property
    def specs(self) -> dict[int, LayerSpec]:
        """Layer -> spec after ``unify_hybrid_kv_cache_specs`` (without the hybrid manager
        sliding and chunked layers are charged as full attention)."""
        out = {}
        for i in range(len(self.layers)):
            s = self.raw_spec(i)
            if s is None:
                continue
            if not self.hybrid and s.kind in (SLIDING, CHUNKED):
                s = LayerSpec(FULL, None, s.page, s.block_size)
            out[i] = s
        return out

    # ------------------------------------------------------------------ groups
    def group_layers(self, layers: Sequence[int]) -> list[VllmGroup]:
        """``get_kv_cache_groups`` over ``layers`` (the whole model from 0.11, a stage's
        layers before)."""
        specs = {i: self.specs[i] for i in layers if i in self.specs}
        if not specs:
            return []
        kinds = {(uniform_type(s.kind), s.window) for s in specs.values()}
        if len(kinds) == 1:  # _get_kv_cache_groups_uniform_spec / _uniform_type
            (kind, window), = kinds
            if len({s.kind for s in specs.values()}) == 1:
                kind = next(iter(specs.values())).kind
            if len({s.page for s in specs.values()}) > 1 and not self.release.global_groups:
                raise ConfigError(f"{self.name} cannot allocate this model's KV cache: its "
                                  "layers' pages differ (vLLM raises NotImplementedError)")
            return [VllmGroup(kind, window, self.block_size, tuple(specs))]
        block_sizes = self._unified_block_sizes(specs)
        by_spec: dict[LayerSpec, list[int]] = {}
        for i, s in specs.items():
            by_spec.setdefault(s, []).append(i)
        counts = [len(members) for members in by_spec.values()]
        size = min(counts)
        ratio = self.release.group_size_ratio
        if ratio is not None and max(counts) < size * ratio:
            size = max(counts)
        groups = []
        for s, members in by_spec.items():
            n = ceil(len(members) / size)
            for g in range(n):
                chunk = (members[g::n] if self.release.interleaved_groups
                         else members[g * size:(g + 1) * size])
                groups.append(VllmGroup(s.kind, s.window, block_sizes[s], tuple(chunk)))
        return groups

    def _unified_block_sizes(self, specs: dict[int, LayerSpec]) -> dict[LayerSpec, int]:
        """Each spec's block size once pages are made equal (``unify_kv_cache_spec_page_
        size``: a smaller page takes proportionally more tokens per block)."""
        pages = {s.page for s in specs.values()}
        largest = max(pages)
        if len(pages) > 1 and (not self.release.unify_page_sizes
                               or any(largest % p for p in pages)):
            raise ConfigError(f"{self.name} cannot allocate this model's KV cache: its "
                              f"layers' pages ({', '.join(map(str, sorted(pages)))} bytes) "
                              "differ and cannot be made equal by block size")
        return {s: self.block_size * largest // s.page for s in specs.values()}

    @cached_property
    def global_groups(self) -> list[VllmGroup]:
        return self.group_layers(range(len(self.layers)))

    def groups_of(self, layers: Sequence[int] | None) -> list[VllmGroup]:
        """The groups a stage holding ``layers`` works with (global from 0.11; before, the
        stage's own; None: the engine's, the global groups)."""
        if layers is None or self.release.global_groups:
            return self.global_groups
        return self.group_layers(self.with_draft(layers))

    @property
    def num_groups(self) -> int:
        return len(self.global_groups)

    @cached_property
    def pages(self) -> dict[int, int]:
        """Each paged layer's page once pages are made equal (the model's largest page;
        with one kind of layer each keeps its own, ``UniformTypeKVCacheSpecs``)."""
        kinds = {(uniform_type(s.kind), s.window) for s in self.specs.values()}
        largest = max((s.page for s in self.specs.values()), default=0)
        return {i: s.page if len(kinds) == 1 else largest for i, s in self.specs.items()}

    # ------------------------------------------------------------------ blocks
    def stage(self, layers: Sequence[int]) -> StageKV:
        layers = self.with_draft(layers)
        held = set(layers)
        per_group = [[i for i in g.layers if i in held] for g in self.groups_of(layers)]
        widest = max(per_group, key=lambda m: sum(self.pages[i] for i in m), default=[])
        block = sum(self.pages[i] for i in widest)
        page = max((self.pages[i] for i in widest), default=0)
        return self._stage_kv(layers, len(widest), page,
                              block if block != len(widest) * page else None)

    def charge(self, group: VllmGroup | LayerSpec, seq_len: int) -> int:
        """Blocks one request of seq_len tokens is charged in a group, or by one layer's
        spec (its ``max_memory_usage_bytes`` / ``page_size_bytes``)."""
        bs = group.block_size
        if group.kind == MAMBA:
            return self.mamba.charge
        if group.kind == SLIDING:
            retained = group.window - 1 + self.extra_retained_tokens + self.in_flight_tokens
            return ceil(min(retained, seq_len) / bs) + 1
        if group.kind == CHUNKED:
            return ceil(min(group.window + self.in_flight_tokens, seq_len) / bs)
        return ceil(seq_len / bs)

    def blocks_per_request(self, seq_len: int, layers: Sequence[int] | None = None) -> int:
        return sum(self.charge(g, seq_len) for g in self.groups_of(layers))

    def held_back(self, kv: StageKV) -> int:
        """The null block, reserved before the check from 0.29 (``get_kv_cache_configs``)."""
        return kv.bytes_per_block if self.release.fit_check == CHECK_NULL_BLOCK else 0

    def check_need(self, layers: Sequence[int], kv: StageKV, seq_len: int) -> int:
        """The need ``_check_enough_kv_cache_memory`` compares with a worker's memory."""
        check = self.release.fit_check
        if check == CHECK_LAYERS:  # each layer's own spec, before any grouping
            return sum(self.charge(s, seq_len) * s.page
                       for s in (self.raw_spec(i) for i in self.with_draft(layers))
                       if s is not None)
        if check == CHECK_GLOBAL:  # the whole model, whatever the stage holds
            layers, kv = range(self.spec.num_layers), self.stage(range(self.spec.num_layers))
        groups = self.groups_of(layers)
        if len(groups) == 1 and kv.block_bytes is not None:  # per-layer pages
            return self.charge(groups[0], seq_len) * kv.bytes_per_block
        if check in (CHECK_GLOBAL, CHECK_FIRST_GROUP):  # group 0's charge stands for all
            return self.charge(groups[0], seq_len) * kv.bytes_per_block
        return self.blocks_per_request(seq_len, layers) * kv.bytes_per_block

    def kv_cache_size(self, num_blocks: int, seq_len: int,
                      layers: Sequence[int] | None = None) -> tuple[int, float]:
        """(KV cache size in tokens, maximum concurrency) as this release logs them, for a
        stage holding ``layers`` (None: the engine's)."""
        groups = self.groups_of(layers)
        if not groups:
            return 0, 0.0
        if self.release.concurrency_from_tokens:  # 0.9.0
            tokens = num_blocks * self.block_size
            return tokens, tokens / seq_len
        concurrency = num_blocks / sum(self.charge(g, seq_len) for g in groups)
        if self.release.tokens_from_concurrency:
            return int(concurrency * seq_len), concurrency
        return num_blocks // len(groups) * min(g.block_size for g in groups), concurrency
