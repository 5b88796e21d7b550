"""``KvmemConnector``'s worker side: kvmem's tiers over one vLLM worker's KV tensors.

Each worker (rank) owns an ``OffloadManager`` (CPU arena, namespaced and checksummed disk
tier, transfer threads) over its own share of the KV cache: vLLM's per-layer KV tensors,
in whatever layout vLLM resolved, are kvmem's slot tensors (``layout``: a block
id is row ``b`` of each distinct view), so a block of any KV cache group is copied whole,
as in kvmem's own engine.

Per step, driven by ``KvmemConnectorMetadata``:

- ``start_load`` (before the forward): each load runs at once and is waited for, so
  the forward reads whole blocks; a block that did not load intact (evicted meanwhile,
  checksum mismatch) and every block after it are reported through
  ``load_errors``, and vLLM recomputes them (``kv_load_failure_policy="recompute"``).
- ``submit_stores`` (after the forward): the finished requests' blocks are copied out on
  the transfer thread; vLLM keeps them allocated until ``finished_sending`` names the
  request, which happens once the last of its blocks is copied (or none needed copying).
- ``report``: the tiers' index changes since the last step, for the scheduler side (tier
  by tier too when vLLM publishes KV events).
- ``stats``: what the tiers did since the last step (``stats.RankStatsDelta``), for vLLM's
  metrics and log line. The lookups a step's metadata names are counted as the tiers'
  hits and misses; each forward that computes prompt tokens is timed from the binding of
  the step's metadata to ``wait_for_save``, less this step's loads, for the rank's prefill
  rate, which values the loads in prefill seconds saved.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.logger import init_logger

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.connector.layout import WorkerKVLayout
from kvmem.integrations.vllm.connector.meta import KvmemConnectorMetadata, TierReport
from kvmem.integrations.vllm.connector.stats import KvmemConnectorStats, RankStatsDelta
from kvmem.plan.types import rank_label
from kvmem.tiers.config import OffloadConfig
from kvmem.tiers.faults import Faults
from kvmem.tiers.manager import OffloadManager
from kvmem.tiers.shared_dir import tier_id
from kvmem.tiers.stats import PrefillMeter
from kvmem.tiers.weights import weights_digest

log = init_logger("vllm.kvmem.connector")  # shown and formatted as vLLM's own lines

LOAD_TIMEOUT_S = 120.0
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


@dataclass(frozen=True)
class RankPlace:
    """Where a worker sits in the deployment: vLLM's global rank and the tensor-parallel
    size, which give its pipeline stage and tensor-parallel rank."""

    rank: int
    tp: int = 1

    @classmethod
    def of(cls, parallel_config: Any) -> RankPlace:
        return cls(parallel_config.rank, parallel_config.tensor_parallel_size)

    def __str__(self) -> str:
        return rank_label(self.rank, self.tp)


class StoreHolds:
    """Which finished request each block held for a store belongs to.

    ``OffloadManager`` holds blocks through its ``BlockHolder`` while they are copied;
    here a hold is vLLM's delayed free, so releasing the last block of a request makes
    the request finished sending."""

    def __init__(self) -> None:
        self.owner = ""  # the request whose offer is being made
        self._owners: dict[int, deque[str]] = defaultdict(deque)
        self._remaining: Counter[str] = Counter()
        self.done: set[str] = set()

    def hold(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._owners[block_id].append(self.owner)
        self._remaining[self.owner] += len(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            owner = self._owners[block_id].popleft()
            if not self._owners[block_id]:
                del self._owners[block_id]
            self._remaining[owner] -= 1
            if self._remaining[owner] == 0:
                del self._remaining[owner]
                self.done.add(owner)


def model_weight_files(model: str, revision: str | None) -> list[Path]:
    """The files holding ``model``'s weights: a local directory's, a file, or the local
    Hugging Face snapshot of a repository id."""
    path = Path(model).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure means: not available locally
            raise ConfigError(f"KvmemConnector: cannot find the weight files of {model!r} "
                              f"to name the disk tier ({exc})") from None
    return sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)


class ForwardTimer:
    """Times forward passes for a ``PrefillMeter``: wall-clock seconds on the CPU; on CUDA,
    events on the compute stream, read once they have completed (never waited for)."""

    def __init__(self, meter: PrefillMeter, cuda: bool) -> None:
        self.meter = meter
        self.cuda = cuda  # the KV cache, and so the forward, is on a CUDA device
        self._start: float | torch.cuda.Event = 0.0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, int, float]] = deque()

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self, tokens: int, excluded_s: float) -> None:
        """The forward since ``start`` computed ``tokens``; ``excluded_s`` of it was not
        the model's (this step's loads)."""
        if isinstance(self._start, float):
            self.meter.observe(tokens, time.perf_counter() - self._start - excluded_s)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._start, end, tokens, excluded_s))
        while self._pending and self._pending[0][1].query():
            start, end, tokens, excluded_s = self._pending.popleft()
            self.meter.observe(tokens, start.elapsed_time(end) / 1000 - excluded_s)


class WorkerSide:
    def __init__(self, config: OffloadConfig, faults: Faults, *, place: RankPlace, model: str,
                 deployment: str, kv_cache_config: Any, tier_events: bool = False) -> None:
        """``tier_events``: report each tier's changes too (vLLM publishes KV events)."""
        self.config = config
        self.faults = faults
        self.place = place
        self.model = model
        self.deployment = deployment
        self.kv_cache_config = kv_cache_config
        self.offload: OffloadManager | None = None
        self.holds = StoreHolds()
        self._lock = threading.Lock()  # tier threads add index changes
        self._changes: list[tuple[str, bool]] = []
        self._held_by_tiers: Counter[str] = Counter()  # block name -> tiers holding it
        self._reported = False
        self._load_errors: set[int] = set()
        self._seen_finished: set[str] = set()
        self.tier_events = tier_events
        self._tier_changes: list[tuple[str, str, bool]] = []
        self.prefill = PrefillMeter()
        self._forward = ForwardTimer(self.prefill, cuda=False)  # until the KV cache is known
        self._load_seconds = 0.0  # this step's loads, inside the timed forward
        self._stats = RankStatsDelta(place.rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        slots = WorkerKVLayout(kv_caches, self.kv_cache_config)
        self.offload = OffloadManager(self.config, slots, slots.num_slots, self.holds,
                                      model=self.model,
                                      layout=f"{self.deployment} {slots.describe()}",
                                      faults=self.faults, on_change=self._on_change,
                                      prefill=self.prefill)
        self._forward = ForwardTimer(self.prefill, cuda=self.offload.copier.on_cuda)
        # a worker that exits without vLLM's shutdown call still writes out queued stores
        atexit.register(self.shutdown)
        log.info("kvmem: %s: KV offload %s, %d KV cache groups (%s), %d slots, %d-byte "
                 "blocks, %s layout", self.place, self.config.describe(), len(slots.rules),
                 ",".join(r.describe() for r in slots.rules), slots.num_slots,
                 self.offload.copier.block_nbytes, slots.layout)

    def _on_change(self, tier: str, name: str, present: bool) -> None:
        """A tier's index changed (tier threads, under the tier's lock): record when the
        rank as a whole starts or stops holding the block."""
        with self._lock:
            if self.tier_events:
                self._tier_changes.append((tier, name, present))
            before = self._held_by_tiers[name]
            after = before + (1 if present else -1)
            if after:
                self._held_by_tiers[name] = after
            else:
                del self._held_by_tiers[name]
            if (before == 0) != (after == 0):
                self._changes.append((name, after > 0))

    # -- per step -------------------------------------------------------------------------
    def step_started(self) -> None:
        """vLLM bound this step's metadata: its forward follows."""
        self._load_seconds = 0.0
        self._forward.start()

    def start_load(self, meta: KvmemConnectorMetadata) -> None:
        assert self.offload is not None
        start = time.perf_counter()
        self.offload.record_lookups((), meta.not_found_blocks)
        if meta.short_hit_keys:
            tiers = (self.offload.find(key) for key in meta.short_hit_keys)
            self.offload.record_short_hit([t for t in tiers if t is not None], 0)
        for job in meta.loads:
            handle = self.offload.load(job.request_id, job.keys, job.block_ids,
                                       job.block_tokens or None)
            # blocks gone since the scheduler's lookup are misses in every tier
            self.offload.record_lookups(handle.tiers, len(job.keys) - len(handle.tiers))
            if not handle.done.wait(LOAD_TIMEOUT_S):
                handle.cancel()  # vLLM recomputes these blocks: a late copy must not land
                log.error("kvmem: load of %d blocks for %s did not finish in %.0f s",
                          len(job.block_ids), job.request_id, LOAD_TIMEOUT_S)
            loaded = handle.num_loaded if handle.done.is_set() else 0
            if loaded < len(job.block_ids):
                failed = sum(t.failed_loads for t in self.offload.stats().values())
                log.warning("kvmem: %s: request %s: %d of %d blocks loaded (%s); vLLM "
                            "recomputes the rest on every rank (failed loads on this rank: "
                            "%d)", self.place, job.request_id, loaded, len(job.block_ids),
                            handle.error or "timed out", failed)
                self._load_errors.update(job.block_ids[loaded:])
        if meta.loads:
            self.offload.poll()
        self._load_seconds += time.perf_counter() - start

    def submit_stores(self, meta: KvmemConnectorMetadata) -> None:
        """After the forward: queue the finished requests' stores."""
        assert self.offload is not None
        if meta.prefill_tokens:
            self._forward.stop(meta.prefill_tokens, self._load_seconds)
        for job in meta.stores:
            self.holds.owner = job.request_id
            queued = self.offload.offer(job.block_ids, job.keys)
            log.info("kvmem: %s: store of %d blocks of request %s: %d held until copied",
                     self.place, len(job.block_ids), job.request_id, queued)
            if queued == 0:
                self.holds.done.add(job.request_id)  # nothing to copy: free at once

    def finished_sending(self, finished_req_ids: set[str]) -> set[str] | None:
        """Requests whose blocks are all copied, once vLLM has told us they finished."""
        if self.offload is not None:
            self.offload.poll()
        self._seen_finished |= finished_req_ids
        done = self.holds.done & self._seen_finished
        self.holds.done -= done
        self._seen_finished -= done
        return done or None

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def report(self) -> TierReport | None:
        if self.offload is None:
            return None
        with self._lock:
            changes, self._changes = self._changes, []
            tier_changes, self._tier_changes = self._tier_changes, []
        if not changes and not tier_changes and self._reported:
            return None
        disk = self.offload.disk
        disk_tiers = {self.place.rank: (str(disk.root), tier_id(disk.root))} \
            if not self._reported and disk is not None and disk.enabled else {}
        self._reported = True
        return TierReport({self.place.rank: changes},
                          {self.place.rank: tier_changes} if tier_changes else {}, disk_tiers)

    def stats(self) -> KvmemConnectorStats | None:
        """What this rank's tiers did since the last call; None when nothing changed."""
        if self.offload is None:
            return None
        return self._stats.take(self.offload.stats(), self.prefill.rate())

    def shutdown(self) -> None:
        if self.offload is not None:
            atexit.unregister(self.shutdown)
            self.offload.shutdown(flush=True)


def worker_identity(vllm_config: Any) -> tuple[str, str]:
    """(model, deployment) of a worker's tiers: the weights by digest, model dtype and
    architecture; the tensor and pipeline sizes, the rank and the KV cache dtype (the KV
    cache groups, their layers and the tensor shapes are added when the tensors are
    registered). The disk tier's namespace is a digest of all of it, so each rank of each
    layout has its own: a directory written at tp 2 never feeds a tp 1 engine."""
    mc = vllm_config.model_config
    digest = weights_digest(model_weight_files(mc.model, getattr(mc, "revision", None)))
    archs = ",".join(getattr(mc.hf_config, "architectures", None) or [])
    dtype = str(mc.dtype).removeprefix("torch.")
    pc = vllm_config.parallel_config
    deployment = (f"vllm tp={pc.tensor_parallel_size} pp={pc.pipeline_parallel_size} "
                  f"rank={pc.rank} kv_dtype={vllm_config.cache_config.cache_dtype}")
    return f"{archs}|dtype={dtype}|weights={digest}", deployment
