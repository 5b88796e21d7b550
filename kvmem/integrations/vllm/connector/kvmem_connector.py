"""``KvmemConnector``: kvmem's CPU and disk tiers behind vLLM's KV connector API (V1).

Turn it on with::

    --kv-transfer-config '{"kv_connector": "KvmemConnector",
                           "kv_connector_module_path": "kvmem.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"cpu_offload_gib": 4,
                               "disk_offload_dir": "/var/cache/kvmem", "disk_offload_gib": 64}}'

vLLM builds one instance per role: in the scheduler process (``SchedulerSide``: lookups
and the plan of each step's loads and stores) and in every worker (``WorkerSide``: the
tiers over that worker's KV tensors). They talk only through the step's metadata and the
workers' reports (``meta``). Settings: ``config``.

Tensor and pipeline parallelism: every worker (rank) keeps its own shard in its own tiers
(its stage's layers, its tensor-parallel KV heads; the disk namespace names the rank and
the layout). The scheduler side decides each load and store once, for all ranks, in the
one metadata vLLM sends every worker; a block counts as a hit only when every rank has
reported it held, and a block that fails to load on any rank is reported by that rank,
vLLM joins the ranks' reports, and the request recomputes from there on every rank.

Hybrid models (sliding-window or chunked local layers beside full attention) keep vLLM's
hybrid KV cache manager: the connector declares ``SupportsHMA`` and stores and loads each
KV cache group by its own rules (``scheduler``). Every KV cache layout vLLM
resolves is read through the tensors it registers (``layout``).

What the tiers do shows where vLLM shows a connector's figures (``stats``): its
``/metrics`` (``kvmem_offload_*`` per tier and rank) and its periodic "KV Transfer metrics"
log line; with ``--kv-events-config``, blocks stored to and evicted from the tiers are
published in vLLM's KV event stream under vLLM's block hashes (``events``).

Not supported, refused at start-up with one line: KV cache specs that are not attention
(the per-request state of Gated DeltaNet, Mamba2 and other linear-attention layers of
hybrid models: a reloaded prefix would need the state at its last token, which this
connector does not store from vLLM's pages), groups of different block sizes, and sleep mode
(``supports_sleep_mode`` is False): sleep mode exists to free or replace the weights while
the engine sleeps, and the tiers, keyed by the checkpoint's digest, would then serve KV the
new weights did not compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmem.errors import ConfigError
from kvmem.integrations.vllm import compat
from kvmem.integrations.vllm.connector.config import parse_extra_config
from kvmem.integrations.vllm.connector.events import TierEvents
from kvmem.integrations.vllm.connector.layout import GroupRule, group_rules
from kvmem.integrations.vllm.connector.meta import KvmemConnectorMetadata
from kvmem.integrations.vllm.connector.scheduler import SchedulerSide
from kvmem.integrations.vllm.connector.stats import KvmemConnectorStats, KvmemPromMetrics
from kvmem.integrations.vllm.connector.worker import RankPlace, WorkerSide, worker_identity

log = init_logger("vllm.kvmem.connector")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _check_deployment(vllm_config: VllmConfig,
                      kv_cache_config: KVCacheConfig) -> tuple[list[GroupRule], int]:
    """Each KV cache group's rule and the block size; ConfigError for what this version
    does not support."""
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        # vLLM 0.33 refuses this itself (supports_sleep_mode); 0.32 has no such hook
        raise ConfigError("KvmemConnector does not support sleep mode (enable_sleep_mode): "
                          "weights changed while asleep would meet KV cached for the old ones")
    rules, block_size = group_rules(kv_cache_config)
    if block_size != vllm_config.cache_config.block_size:
        raise ConfigError(f"KvmemConnector: KV cache group block size {block_size} differs "
                          f"from the scheduler's {vllm_config.cache_config.block_size}")
    return rules, block_size


def _publishes_events(vllm_config: VllmConfig) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


class KvmemConnector(KVConnectorBase_V1, SupportsHMA):
    """kvmem's offload tiers as a vLLM KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        version = compat.require("connector")
        super().__init__(vllm_config, role, kv_cache_config)
        config, faults = parse_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        rules, block_size = _check_deployment(vllm_config, kv_cache_config)
        self._cache_hit_source = CacheHitSource.HOST if config.cpu_bytes else CacheHitSource.DISK
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if warning := compat.untested_warning(version):
                log.warning("kvmem: %s", warning)
            world_size = vllm_config.parallel_config.world_size
            events = TierEvents(world_size, block_size, getattr(
                kv_cache_config, "hash_block_size", None) or block_size) \
                if _publishes_events(vllm_config) else None
            self.scheduler_side = SchedulerSide(rules, block_size, world_size, events,
                                                min_load_tokens=config.min_load_tokens)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("kvmem: kv_load_failure_policy is %r: a block that leaves a tier "
                            "between lookup and load fails its request; 'recompute' "
                            "recomputes it instead",
                            self._kv_transfer_config.kv_load_failure_policy)
        else:
            model, deployment = worker_identity(vllm_config)
            self.worker_side = WorkerSide(
                config, faults, place=RankPlace.of(vllm_config.parallel_config), model=model,
                deployment=deployment, kv_cache_config=kv_cache_config,
                tier_events=_publishes_events(vllm_config))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # see the module docstring; vLLM 0.33 asks this before it starts

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that is skipped is a later miss, nothing more

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.step_started()  # the forward pass follows

    def _meta(self) -> KvmemConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmemConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker_side is not None
        self.worker_side.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # blocks are stored whole when their request finishes (wait_for_save)

    def wait_for_save(self) -> None:
        assert self.worker_side is not None
        self.worker_side.submit_stores(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        assert self.worker_side is not None
        return self.worker_side.finished_sending(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker_side is not None
        return self.worker_side.load_errors()

    def build_connector_worker_meta(self) -> Any:
        assert self.worker_side is not None
        return self.worker_side.report()

    def get_kv_connector_stats(self) -> KvmemConnectorStats | None:
        return self.worker_side.stats() if self.worker_side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvmemConnectorStats:
        return KvmemConnectorStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvmemPromMetrics:
        return KvmemPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(
            scheduler_output.num_scheduled_tokens.values())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        return self.scheduler_side.take_events() if self.scheduler_side is not None else []

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_block_frees()
