"""How big an elastic KV cache's reservation is, and what its limit allows (no torch).

The reservation is virtual: it costs address space, not memory, so it is sized for the
largest pool the engine could ever use, and the limit (the planned KV budget by default)
decides how much of it may be backed by physical pages at once:

    max_blocks = max(limit blocks, min(device blocks, useful blocks))

- *device blocks*: what the device's free memory could hold;
- *useful blocks*: ``max_num_seqs`` requests of ``max_model_len`` at once, plus the null
  block; a pool beyond that could only hold more prefix-cache data, and every block costs
  the block manager a little host memory whether or not it is backed;
- *limit blocks*: what the limit pays for, so raising the limit up to the reservation
  (``kvmem limit``) needs no restart.

``kvmem plan --kv-memory elastic`` and the engine both call ``elastic_sizing``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import ceil, lcm

from kvmem.errors import ConfigError
from kvmem.memory.pages import PageGeometry, blocks_per_page_for
from kvmem.spec.layout import AttentionKind, KVGroup
from kvmem.units import format_bytes

CUDA_GRANULARITY = 2 << 20  # the usual cuMemGetAllocationGranularity on current GPUs


@dataclass(frozen=True)
class ElasticSizing:
    max_blocks: int  # blocks the reservation covers: the block pool's size
    blocks_per_page: int
    page_bytes: int  # one page across all slots of the rank
    reserved_bytes: int  # the rank's virtual range
    limit_bytes: int  # most physical KV bytes mapped at once (the ledger limit)
    limit_blocks: int  # blocks the limit can back, counted in whole pages
    # one page as the ledger counts it: the rank's own, or, where every rank's KV lives
    # in one host's memory (the CPU), the page of every rank together
    ledger_page_bytes: int

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def useful_blocks(groups: Iterable[KVGroup], *, max_model_len: int, block_size: int,
                  max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Blocks that ``max_num_seqs`` requests of ``max_model_len`` hold at once, + the null."""
    per_request = sum(g.blocks_per_request(max_model_len, block_size, max_num_batched_tokens)
                      for g in groups if g.kind is not AttentionKind.LINEAR)
    return max_num_seqs * per_request + 1


def elastic_sizing(*, num_slots: int, block_slot_bytes: int, limit_bytes: int,
                   device_blocks: int | None, useful: int, granularity: int,
                   blocks_per_page: int | None = None, max_blocks: int | None = None,
                   ledger_page_bytes: int | None = None) -> ElasticSizing:
    """The reservation and limit of one rank.

    ``block_slot_bytes``: one block in one slot tensor; ``device_blocks``: blocks the
    device's free memory could hold (None: unknown, the useful size decides). A parallel
    engine's ranks agree on ``blocks_per_page`` and ``max_blocks`` and pass them here, and,
    where the ledger counts all of them in one memory, ``ledger_page_bytes``: one page of
    every rank, which the limit is counted in.
    """
    if num_slots < 1 or block_slot_bytes < 1:
        raise ConfigError("an elastic KV cache needs at least one paged layer")
    if limit_bytes < 1:
        raise ConfigError(f"the KV memory limit must be positive, got {limit_bytes}")
    k = blocks_per_page or blocks_per_page_for(block_slot_bytes, granularity)
    page_bytes = k * block_slot_bytes * num_slots
    ledger_page_bytes = ledger_page_bytes or page_bytes
    limit_blocks = limit_bytes // ledger_page_bytes * k
    if max_blocks is None:
        device = useful if device_blocks is None else device_blocks
        max_blocks = max(limit_blocks, min(device, useful), 2 * k)
    geo = PageGeometry.build(num_slots=num_slots, block_slot_bytes=block_slot_bytes,
                             max_blocks=ceil(max_blocks / k) * k, granularity=granularity,
                             blocks_per_page=k)
    return ElasticSizing(max_blocks=geo.num_blocks, blocks_per_page=k, page_bytes=page_bytes,
                         reserved_bytes=geo.reserved_bytes, limit_bytes=limit_bytes,
                         limit_blocks=min(limit_blocks, geo.num_blocks),
                         ledger_page_bytes=ledger_page_bytes)


def plan_elastic(plan, spec, limit_bytes: int | None = None,
                 granularity: int = CUDA_GRANULARITY, *,
                 one_memory: bool = False) -> list[ElasticSizing]:
    """Every rank's sizing for a ``kvmem.plan`` result, as the engine would agree on it.

    The limit and the smallest device decide one reservation in blocks; each rank
    reserves that many blocks of its own slot tensors. The limit counts what the ledger
    of rank 0's device holds: rank 0's KV on its own GPU (default: its planned KV
    budget), or, with ``one_memory`` (the CPU, where every rank's KV is in the host's
    memory), every rank's (default: their planned budgets together).
    """
    settings, engine = plan.settings, plan.engine
    useful = useful_blocks(spec.kv_groups(), max_model_len=engine.max_model_len,
                           block_size=engine.block_size,
                           max_num_batched_tokens=settings.max_num_batched_tokens,
                           max_num_seqs=settings.max_num_seqs)
    paged = [r for r in plan.ranks if r.num_slots and r.slot_page_bytes]
    if not paged:
        raise ConfigError("an elastic KV cache needs at least one paged layer")
    k = lcm(*(blocks_per_page_for(r.slot_page_bytes, granularity) for r in paged))
    known = [r.kv_capacity_bytes // r.bytes_per_block for r in paged
             if r.kv_capacity_bytes is not None]
    leader = paged[0]
    counted = paged if one_memory else [leader]
    limit = limit_bytes or sum(r.kv_budget_bytes for r in counted)
    ledger_page = sum(k * r.slot_page_bytes * r.num_slots for r in counted)
    first = elastic_sizing(num_slots=leader.num_slots, block_slot_bytes=leader.slot_page_bytes,
                           limit_bytes=limit, device_blocks=min(known) if known else None,
                           useful=useful, granularity=granularity, blocks_per_page=k,
                           ledger_page_bytes=ledger_page)
    return [elastic_sizing(num_slots=r.num_slots, block_slot_bytes=r.slot_page_bytes,
                           limit_bytes=limit, device_blocks=None, useful=useful,
                           granularity=granularity, blocks_per_page=k,
                           max_blocks=first.max_blocks, ledger_page_bytes=ledger_page)
            if r is not leader else first for r in paged]


CPU_GRANULARITY = 4096  # the OS page vLLM's CPU build maps (x86-64 Linux)


@dataclass(frozen=True)
class VllmElasticSizing:
    """What ``KVMEM_VLLM_KV_MEMORY=elastic`` makes of a planned vLLM deployment, as its
    scheduler side sizes it (``kvmem.integrations.vllm.elastic_connector``): vLLM's own KV
    cache is the reservation, mapped in pages of whole blocks that fill whole granules
    (the OS page on vLLM's CPU build, the driver's 2 MiB granule on a GPU)."""

    granularity: int
    blocks_per_page: int
    reserved_blocks: int  # vLLM's KV cache blocks, in whole pages
    block_bytes: int  # per block, as the ledger counts it: every rank's on one host (CPU),
    # rank 0's on its GPU (each GPU is its own ledger's device)
    page_bytes: int
    reserved_bytes: int
    limit_bytes: int  # default: the whole reservation
    limit_blocks: int  # blocks the limit can back, in whole pages
    request_pages: int  # pages one request of max_model_len maps, + the null block's page

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def fit_error(self, max_model_len: int) -> str | None:
        """Why vLLM would refuse to start under this limit, if it would (its figures)."""
        pages = self.limit_bytes // self.page_bytes
        if pages >= self.request_pages:
            return None
        return (f"the elastic KV memory limit {format_bytes(self.limit_bytes)} holds "
                f"{pages:,} pages of {self.blocks_per_page} blocks but one request of "
                f"max_model_len "
                f"{max_model_len:,} needs {self.request_pages:,} (incl. the null block's); "
                "raise --kv-memory-limit or lower --max-model-len")


def plan_vllm_elastic(plan, spec, limit_bytes: int | None = None, *, on_cpu: bool,
                      granularity: int | None = None) -> VllmElasticSizing:
    """The elastic KV memory of a ``kvmem.plan`` result deployed on vLLM (``on_cpu``: its
    CPU build, where every rank's KV lives in the one host's memory; ``granularity``:
    another than the device's, the huge page on the CPU)."""
    settings, engine = plan.settings, plan.engine
    paged = [r for r in plan.ranks if r.num_slots and r.slot_page_bytes]
    if not paged:
        raise ConfigError("an elastic KV cache needs at least one paged layer")
    granularity = granularity or (CPU_GRANULARITY if on_cpu else CUDA_GRANULARITY)
    # vLLM lays each layer's blocks out one after another: a block of one layer is the
    # stride every page must cover in whole granules
    k = lcm(*(blocks_per_page_for(r.slot_page_bytes, granularity) for r in paged))
    reserved_blocks = engine.num_blocks // k * k
    block_bytes = sum(r.bytes_per_block for r in paged) if on_cpu else paged[0].bytes_per_block
    page_bytes = k * block_bytes
    reserved = reserved_blocks * block_bytes
    limit = limit_bytes or reserved
    request = useful_blocks(spec.kv_groups(), max_model_len=engine.max_model_len,
                            block_size=engine.block_size,
                            max_num_batched_tokens=settings.max_num_batched_tokens,
                            max_num_seqs=1) - 1  # without the null block
    return VllmElasticSizing(
        granularity=granularity, blocks_per_page=k, reserved_blocks=reserved_blocks,
        block_bytes=block_bytes, page_bytes=page_bytes, reserved_bytes=reserved,
        limit_bytes=limit, limit_blocks=min(limit // page_bytes * k, reserved_blocks),
        request_pages=ceil(request / k) + 1)
