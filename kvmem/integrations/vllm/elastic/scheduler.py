"""The elastic connector's scheduler side in vLLM's engine core: ``ElasticScheduler``.

It registers the engine in its device's ledger, sizes the pages (``blocks_per_page``)
and the limit, puts ``pool.ElasticBlockQueue`` in place of vLLM's free-block queue
(``bind``), connects the workers' KV memory files where the scheduler may release pages
in them (``connect_workers``), asks other engines for memory for requests the limit
keeps waiting (``memory_coming``, ``step_meta``) and ends each step with the mapping
decisions for every worker (``ElasticStepMeta``). ``LedgerWatch`` wakes vLLM's engine
core when another engine asks this one for memory while it is idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.utils import get_pp_indices
from vllm.logger import init_logger

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.elastic import hybrid
from kvmem.integrations.vllm.elastic.config import LIMIT_ENV, ElasticSettings
from kvmem.integrations.vllm.elastic.config import ledger_device as elastic_ledger_device
from kvmem.integrations.vllm.elastic.layout import KVLayout, TensorPlacement
from kvmem.integrations.vllm.elastic.pool import BlockRange, ElasticPool
from kvmem.integrations.vllm.elastic.release import WorkerFile
from kvmem.integrations.vllm.elastic.watch import LedgerWatch
from kvmem.memory.budget import MemoryWait
from kvmem.memory.huge_pages import huge_page_size
from kvmem.memory.ledger import Ledger
from kvmem.memory.pages import blocks_per_page_for
from kvmem.memory.sizing import CUDA_GRANULARITY
from kvmem.units import format_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("vllm.kvmem.elastic")


@dataclass
class ElasticStepMeta(KVConnectorMetadata):
    """One step's message to every worker: mapping decisions in order, numbered."""

    seq: int
    ops: tuple[BlockRange, ...]
    # The first message: the KV bytes per block the ledger counts for each rank.
    block_bytes: tuple[int, ...] | None = None


def rank_block_bytes(vllm_config: VllmConfig, own: int,
                     kv_cache_config: KVCacheConfig | None = None) -> list[int]:
    """Every worker's KV bytes per block, in rank order, from the scheduler's (stage 0's)
    own: pipeline stages hold their share of the layers (vLLM's split); a hybrid's, the
    KV tensors kvmem's plan gives them (``hybrid``)."""
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    if pp == 1:
        return [own] * tp
    if kv_cache_config is not None and hybrid.state_groups(kv_cache_config):
        planned = hybrid.planned_rank_block_bytes(vllm_config, kv_cache_config, own)
        if planned is not None:
            return planned
    n = vllm_config.model_config.hf_text_config.num_hidden_layers
    layers = [end - start for start, end in (get_pp_indices(n, s, pp) for s in range(pp))]
    return [own * layers[stage] // layers[0] for stage in range(pp) for _ in range(tp)]


def blocks_per_page(placements: list[TensorPlacement], granularity: int) -> int:
    """Fewest blocks whose bytes fill whole granules in every tensor."""
    return math.lcm(*(blocks_per_page_for(p.block_stride, granularity) for p in placements))


def _request_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Blocks one request of ``max_model_len`` holds (every KV cache group)."""
    return sum(math.ceil(g.kv_cache_spec.max_memory_usage_bytes(vllm_config)
                         / g.kv_cache_spec.page_size_bytes)
               for g in kv_cache_config.kv_cache_groups)


class ElasticScheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: ElasticSettings) -> None:
        pc = vllm_config.parallel_config
        layout = KVLayout.from_kv_cache_config(kv_cache_config)
        self.rank_bytes = rank_block_bytes(vllm_config, layout.block_bytes, kv_cache_config)
        device = vllm_config.device_config.device_type
        self.device = device
        self.world_size = pc.world_size
        # One step at a time (no batch queue): no step is in flight while it schedules.
        self.one_batch = vllm_config.max_concurrent_batches == 1
        ledger_device = elastic_ledger_device(device)
        if device == "cpu":
            import mmap

            granularity = huge_page_size() if settings.huge_pages else mmap.PAGESIZE
            block_bytes = sum(self.rank_bytes)  # every rank's KV lives in this memory
        else:
            granularity = CUDA_GRANULARITY
            block_bytes = self.rank_bytes[0]  # rank 0's device; other ranks' are their own
        k = blocks_per_page(layout.placements, granularity)
        usable = kv_cache_config.num_blocks // k * k
        reserved = usable * block_bytes
        page_bytes = k * block_bytes
        limit = settings.limit_bytes or reserved
        if limit > reserved:
            log.warning("kvmem: %s=%s is above vLLM's KV cache of %s: the engine can map at "
                        "most that", LIMIT_ENV, format_bytes(limit), format_bytes(reserved))
        need = math.ceil(_request_blocks(vllm_config, kv_cache_config) / k) + 1
        if limit // page_bytes < need:
            raise ConfigError(
                f"the KV memory limit {format_bytes(limit)} holds {limit // page_bytes} pages "
                f"of {k} blocks ({format_bytes(page_bytes)} each) but one request of "
                f"max_model_len {vllm_config.model_config.max_model_len:,} needs {need} (incl. "
                f"the null block's); raise {LIMIT_ENV} or lower max_model_len")
        budget = Ledger.for_device(ledger_device, settings.ledger_dir).register(
            settings.engine_name, floor_bytes=settings.floor_bytes or 0, ceiling_bytes=limit,
            request_bytes=need * page_bytes)
        try:
            self.pool = ElasticPool(num_blocks=kv_cache_config.num_blocks, blocks_per_page=k,
                                    block_bytes=block_bytes, budget=budget)
        except BaseException:
            budget.close()
            raise
        self.watch = LedgerWatch(budget, lambda: self.pool.table.held_bytes)
        self.block_size = hybrid.attention_block_size(kv_cache_config)
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self._considered: dict[str, int] = {}  # waiting requests vLLM looked at this step
        self._last_running = 0  # requests the last step scheduled
        self._memory_wait = MemoryWait()
        self.bound = False
        log.info("kvmem: elastic KV memory: engine %r in the %s ledger %s: %s reserved (%d "
                 "blocks over %d ranks), pages of %d blocks (%s), limit %s", settings.engine_name,
                 ledger_device, budget.ledger.path, format_bytes(reserved), usable,
                 pc.world_size, k, format_bytes(page_bytes), format_bytes(limit))

    def bind(self, block_pool: BlockPool) -> None:
        """Put the page-aware queue in place of vLLM's free-block queue (a fresh pool:
        every block free but the null block)."""
        if self.bound:
            raise ConfigError("kvmem elastic KV memory: a second block pool was bound")
        queue = block_pool.free_block_queue
        if block_pool.null_block.block_id != 0 or queue.num_free_blocks != len(
                block_pool.blocks) - 1:
            raise ConfigError("kvmem elastic KV memory: vLLM's block pool is not fresh (null "
                              "block 0, every other block free) when it is bound")
        block_pool.free_block_queue = self.pool.queue(block_pool.blocks, block_pool.evict_blocks)
        self.bound = True

    def connect_workers(self, files: list[WorkerFile]) -> None:
        """Release given-back pages in the workers' KV memory files from here (``files``
        from vLLM's connector handshake), where that is safe and every worker named one."""
        if self.device != "cpu" or not self.one_batch:
            return
        if sorted(f.rank for f in files) != list(range(self.world_size)):
            log.info("kvmem: elastic KV memory: %d of %d workers named a KV memory file; "
                     "pages given back reach the workers with a step", len(files),
                     self.world_size)
            return
        if self.pool.connect_files(files):
            log.info("kvmem: elastic KV memory: pages given back are released by the "
                     "scheduler in the %d workers' KV memory files", len(files))

    def consider(self, request: Request) -> None:
        """vLLM looks at a waiting request to schedule it."""
        self._considered[request.request_id] = request.num_tokens

    def memory_coming(self) -> bool:
        """A running request is short of blocks because the limit held them back: ask
        other engines for a block for every request that ran last step (each may need
        one), and whether some memory is coming; then vLLM waits for it instead of
        preempting a request whose KV it would compute again, as long as some arrives
        every 5 s (``MemoryWait``)."""
        if not self.pool.limited:
            return False
        blocks = max(1, self._last_running) * self.num_groups
        coming = self.pool.want(blocks)
        if self._memory_wait(coming, self.pool.table.held_bytes):
            return True
        view = self.pool.view
        log.info("kvmem: a running request is short of KV blocks under the limit and %s "
                 "(room %s bytes, %d blocks wanted, %d free on mapped pages): vLLM preempts",
                 "none came for 5 s" if coming else "no other engine can give any",
                 view.room, blocks, self.pool.table.free_within(0))
        return False

    def step_meta(self, scheduler_output: SchedulerOutput | None = None) -> ElasticStepMeta:
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        self._last_running = len(scheduled)
        waiting = [n for rid, n in self._considered.items() if rid not in scheduled]
        self._considered.clear()
        if waiting and self.pool.limited:  # the limit kept them waiting: ask for them
            # vLLM looks at waiting requests only until one does not fit, so the rest of a
            # burst is not seen yet: ask for as many like the largest as the batch has seats
            # left, so that an idle engine is woken once for a burst, not once per request
            per_request = max(-(-n // self.block_size) for n in waiting)
            seats = max(len(waiting), self.max_num_seqs - len(scheduled))
            self.pool.want(per_request * seats * self.num_groups)
        scheduled_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        ops = tuple(self.pool.end_step(idle=scheduled_tokens == 0))
        first = self.pool.seq == 1
        return ElasticStepMeta(self.pool.seq, ops, tuple(self.rank_bytes) if first else None)

    def close(self) -> None:
        self.watch.stop()
        self.pool.close()
