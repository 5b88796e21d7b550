"""``KvmemElasticConnector``: kvmem's elastic KV memory inside vLLM, as a KV connector (V1).

The plugin adds it to vLLM's KV transfer config when ``KVMEM_VLLM_KV_MEMORY=elastic``
(``config``; beside any connector already configured, through vLLM's
``MultiConnector``). vLLM builds one instance per process:

- in the engine core (scheduler role): ``scheduler.ElasticScheduler`` registers the engine in the
  ledger, and in ``bind_gpu_block_pool`` puts ``pool.ElasticBlockQueue`` in place
  of vLLM's free-block queue; each ``build_connector_meta`` ends the step and sends its
  mapping decisions (``ElasticStepMeta``) to every worker; ``has_pending_push_work``
  keeps vLLM stepping until pages freed by the last step are given back;
- in every worker: ``worker.ElasticWorker`` places vLLM's KV buffer over the
  reservation (``get_mem_pool_context``) and applies each step's message before vLLM
  touches the step's blocks (``handle_preemptions``, called first in ``execute_model``);
- on the CPU, each worker names its KV memory file in vLLM's connector handshake
  (``get_handshake_metadata``) and the scheduler releases the pages it gives back in
  those files itself (``release.WorkerFiles``; ``set_xfer_handshake_metadata_pp_aware``).

It loads and stores no KV: lookups answer 0 tokens, and requests finish at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvmem.errors import ConfigError
from kvmem.integrations.vllm import compat
from kvmem.integrations.vllm.elastic.config import settings_from_extra
from kvmem.integrations.vllm.elastic.layout import KVLayout
from kvmem.integrations.vllm.elastic.release import WorkerFile
from kvmem.integrations.vllm.elastic.scheduler import ElasticScheduler, ElasticStepMeta
from kvmem.integrations.vllm.elastic.worker import ElasticWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("vllm.kvmem.elastic")


@dataclass
class ElasticHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV memory file, for the scheduler to release pages in."""

    file: WorkerFile


class KvmemElasticConnector(KVConnectorBase_V1, SupportsHMA):
    """kvmem's elastic KV memory as a vLLM KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        compat.require("elastic")
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            # vLLM 0.33 asks supports_sleep_mode itself; 0.32 has no such hook
            raise ConfigError("elastic KV memory does not support sleep mode "
                              "(enable_sleep_mode): vLLM's sleep frees the KV cache through "
                              "its own memory pool, and kvmem's pages are not in it")
        super().__init__(vllm_config, role, kv_cache_config)
        settings = settings_from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler_side: ElasticScheduler | None = None
        self.worker_side: ElasticWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = ElasticScheduler(vllm_config, kv_cache_config, settings)
        else:
            pc = vllm_config.parallel_config
            self.worker_side = ElasticWorker(
                layout=KVLayout.from_kv_cache_config(kv_cache_config), settings=settings,
                rank=pc.rank, tensor_parallel_size=pc.tensor_parallel_size,
                pipeline_parallel_size=pc.pipeline_parallel_size,
                has_peers=pc.world_size > 1)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # see __init__

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side ----------------------------------------------------------------------
    def get_mem_pool_context(self) -> Any:
        assert self.worker_side is not None
        return self.worker_side.allocation_context()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This worker's KV memory file (CPU), unless a connector beside it has a handshake
        of its own: vLLM's ``MultiConnector`` passes on only the first one."""
        if self.worker_side is None or not _only_kvmem_connectors(self):
            return None
        file = self.worker_side.shared_file()
        return None if file is None else ElasticHandshake(file)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker_side is not None and isinstance(kv_connector_metadata, ElasticStepMeta)
        meta = kv_connector_metadata
        self.worker_side.apply(meta.seq, meta.ops, meta.block_bytes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # -- scheduler side -------------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.bind(gpu_block_pool)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.connect_workers(
                [m.file for m in metadata.values() if isinstance(m, ElasticHandshake)])

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        assert self.scheduler_side is not None
        self.scheduler_side.consider(request)  # what waits, if the limit keeps it waiting
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.step_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_block_frees(self) -> bool:
        """Memory other engines are giving back: a running request short of blocks waits
        for it rather than preempting another."""
        return self.scheduler_side is not None and self.scheduler_side.memory_coming()

    def has_pending_push_work(self) -> bool:
        """Pages freed by the last step reach the workers with the next one: keep stepping
        until they have."""
        return self.scheduler_side is not None and self.scheduler_side.pool.has_pending()

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.close()


def _only_kvmem_connectors(ours: KvmemElasticConnector) -> bool:
    """Whether every connector beside ``ours`` in vLLM's KV transfer group is kvmem's."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvmem.integrations.vllm.connector.kvmem_connector import KvmemConnector

    if not has_kv_transfer_group():
        return True
    others = [c for c in getattr(get_kv_transfer_group(), "sub_connectors", []) if c is not ours]
    return all(isinstance(c, KvmemConnector) for c in others)


def worker_stats(_worker: Any = None) -> dict[str, int] | None:
    """This worker's elastic KV figures (for ``LLM.collective_rpc``): mapped blocks and
    bytes, resident bytes of the reservation, maps and unmaps; None when it has none."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    group = get_kv_transfer_group()
    for c in [group, *getattr(group, "sub_connectors", [])]:
        if isinstance(c, KvmemElasticConnector) and c.worker_side is not None:
            return c.worker_side.stats()
    return None
