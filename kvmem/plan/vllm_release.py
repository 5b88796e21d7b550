"""Which of vLLM's KV cache rules a vLLM release follows, from 0.9.0 to 0.33.

Each rule below was read in the source of the vLLM wheels of these releases
(``vllm/v1/kv_cache_interface.py``, ``vllm/v1/core/kv_cache_utils.py``, from 0.33
``vllm/v1/core/kv_cache_planning.py``, ``vllm/config``); the release named is the first
that has it. ``kvmem.plan.vllm_rules`` applies them. Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvmem.errors import ConfigError

OLDEST = (0, 9, 0)
NEWEST = (0, 33)  # the newest series whose rules were read
DEFAULT_VERSION = "0.33"  # what `kvmem plan` follows when no version is given

# Fit checks (``check_enough_kv_cache_memory`` and what replaced it), by how vLLM counts
# the need of one request of max_model_len and what it compares it with.
CHECK_LAYERS = "layers"  # each layer's max_memory_usage_bytes summed, per worker
CHECK_GLOBAL = "global"  # the whole model's groups against the smallest worker's memory
CHECK_FIRST_GROUP = "first-group"  # per worker, but every group charged like group 0
CHECK_GROUPS = "groups"  # per worker: bytes per block x the blocks of all groups
CHECK_NULL_BLOCK = "groups-null-block"  # the same, less the null block from the memory


@dataclass(frozen=True)
class VllmRelease:
    """A vLLM release and the KV cache rules it follows."""

    version: tuple[int, ...]  # at least three parts: 0.11 is (0, 11, 0)
    name: str = ""  # as given: "0.11", "0.10.1.1"

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", (*self.version, 0, 0, 0)[:max(3, len(self.version))])
        if not self.name:
            object.__setattr__(self, "name", ".".join(map(str, self.version)))

    @classmethod
    def parse(cls, text: str) -> VllmRelease:
        """``0.32``, ``0.10.1.1``, ``v0.11.0``, ``0.11.0rc2`` or ``0.32.0+cpu``."""
        m = re.fullmatch(r"v?(\d+)\.(\d+)((?:\.\d+)*)(?:[.+-]?(?:rc|dev|post|\+)\S*)?",
                         text.strip())
        if m is None:
            raise ConfigError(f"--vllm-version: cannot read {text!r} as a vLLM version "
                              "(e.g. 0.32 or 0.10.1.1)")
        version = (int(m[1]), int(m[2]), *(int(x) for x in m[3].split(".") if x))
        if (*version, 0)[:3] < OLDEST:  # 0.9 is 0.9.0, not older than it
            raise ConfigError(f"vLLM {text}: kvmem knows the KV cache rules of vLLM 0.9 to "
                              f"{'.'.join(map(str, NEWEST))} (vLLM's V1 engine)")
        return cls(version, ".".join(map(str, version)))

    @property
    def newer_than_known(self) -> bool:
        """A release after the newest whose rules were read: its rules are assumed."""
        return self.version[:2] > NEWEST

    def since(self, *version: int) -> bool:
        return self.version >= version

    # ------------------------------------------------------------------ KV cache groups
    @property
    def hybrid_manager(self) -> bool:
        """Layers of different kinds get groups of their own (``_get_kv_cache_config_
        uniform_page_size``, 0.9.1); before, every sliding-window layer was charged as full
        attention (``unify_hybrid_kv_cache_specs``)."""
        return self.since(0, 9, 1)

    @property
    def chunked_local_spec(self) -> bool:
        """``ChunkedLocalAttentionSpec`` exists (0.10.0); before, chunked layers were full."""
        return self.since(0, 10, 0)

    @property
    def chunked_local_disables_hybrid(self) -> bool:
        """A model with chunked local attention turns the hybrid manager off by default
        (``VllmConfig.__post_init__``, 0.10.1, unless ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_
        HYBRID_KV_CACHE=1``); from 0.14 that variable defaults to 1 (``vllm/envs.py``), so the
        manager stays on."""
        return self.since(0, 10, 1) and not self.since(0, 14)

    @property
    def cpu_hybrid(self) -> bool:
        """vLLM's CPU platform supports the hybrid manager (``support_hybrid_kv_cache``,
        0.10.2); before, only CUDA and ROCm did."""
        return self.since(0, 10, 2)

    @property
    def global_groups(self) -> bool:
        """The groups are formed once from the whole model and each pipeline stage takes its
        layers of every group (``get_kv_cache_configs``, 0.11.0); before, each worker grouped
        its own layers (``get_kv_cache_config`` per worker)."""
        return self.since(0, 11, 0)

    @property
    def interleaved_groups(self) -> bool:
        """Group i of a kind takes its layers ``[i::n]`` (0.11.0), so that every pipeline
        stage holds about as many of each group; before, consecutive runs of the group
        size."""
        return self.since(0, 11, 0)

    @property
    def group_size_ratio(self) -> float | None:
        """The group size is the fewest layers of a kind, unless the most layers of a kind
        is below this many times that, then the most (``_get_kv_cache_groups_uniform_page_
        size``: 1.25 from 0.12, 1.5 from 0.18)."""
        if self.since(0, 18):
            return 1.5
        return 1.25 if self.since(0, 12) else None

    @property
    def unify_page_sizes(self) -> bool:
        """Layers with smaller pages get larger blocks so that every page is the same size
        (``unify_kv_cache_spec_page_size``, 0.12); before, mixed page sizes were refused."""
        return self.since(0, 12)

    @property
    def gpu_backend_block_size(self) -> bool:
        """On a GPU the attention backends' kernels decide the block size
        (``Platform.update_block_size_for_backend``; read from 0.32, kvmem.plan.
        vllm_backends); older releases are planned with blocks of 16."""
        return self.since(0, 32)

    # ------------------------------------------------------------------ charges
    @property
    def gdn_prefill_checkpoints(self) -> bool:
        """Gated DeltaNet layers whose prefill runs on FlashInfer export prefill
        checkpoints in align mode: one more state block per request and a block size
        aligned to 64 tokens (``GatedDeltaNetAttention.get_kv_cache_spec``, 0.33)."""
        return self.since(0, 33)

    @property
    def replayssm(self) -> bool:
        """``--use-replayssm``: Mamba2 layers keep a ring of their last inputs beside the
        state (``MambaStateShapeCalculator.append_replayssm_ring``; read in 0.32 and 0.33,
        earlier releases not)."""
        return self.since(0, 32)

    @property
    def replayssm_repeats_groups(self) -> bool:
        """The ring's B/C groups are repeated on each rank as the conv state's are, when tp
        does not divide them (0.33); 0.32 divides the config's groups, and fails if tp
        does not divide them."""
        return self.since(0, 33)

    @property
    def in_flight_batches(self) -> bool:
        """Sliding-window and chunked-local charges count ``max_concurrent_batches`` times
        ``max_num_batched_tokens`` (``VllmConfig.max_in_flight_tokens``, 0.26); before,
        ``max_num_batched_tokens`` once."""
        return self.since(0, 26)

    @property
    def fit_check(self) -> str:
        """How the start-up check counts the need of one request of max_model_len."""
        if self.since(0, 29):
            return CHECK_NULL_BLOCK
        if self.since(0, 19):
            return CHECK_GROUPS
        if self.since(0, 17):
            return CHECK_FIRST_GROUP
        if self.since(0, 14):
            return CHECK_GLOBAL
        return CHECK_LAYERS

    # ------------------------------------------------------------------ log lines
    @property
    def tokens_from_concurrency(self) -> bool:
        """The logged KV cache size is ``int(concurrency x max_model_len)`` (0.20.1);
        before, ``num_blocks // number of groups x block_size``."""
        return self.since(0, 20, 1)

    @property
    def concurrency_from_tokens(self) -> bool:
        """0.9.0 logged the maximum concurrency as the KV cache size / max_model_len;
        later releases as blocks / the blocks one request needs in all groups
        (``get_max_concurrency_for_kv_cache_config``)."""
        return not self.since(0, 9, 1)

    @property
    def logs_per_worker(self) -> bool:
        """Each worker logged its own KV cache size from its own blocks, before the engine
        took the smallest (until 0.11.0); from 0.11.1 it is logged once, after."""
        return not self.since(0, 11, 1)

    @property
    def one_log_line(self) -> bool:
        """Size and concurrency on one line (0.28); before, two lines."""
        return self.since(0, 28)

    @property
    def device_in_log(self) -> bool:
        """The size line names the device, ``CPU KV cache size`` (0.30); before, always
        ``GPU KV cache size``."""
        return self.since(0, 30)
