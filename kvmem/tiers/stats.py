"""What each tier reports: its counters (``TierStats``), their metric names and help, and
the engine's measured prefill rate that values its loads (``PrefillMeter``).

One definition serves every place the figures appear: ``kvmem serve``'s ``/metrics``,
vLLM's ``/metrics`` and periodic log line (``KvmemConnector``), ``kvmem top`` and
``kvmem vllm-check --stats``. Each field ``f`` is the metric ``kvmem_offload_<f>``, labelled
``tier`` ("cpu", "disk"); counters end in ``_total`` on ``/metrics``, failed loads carry a
``cause`` label. Pure Python (no torch).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

# Why a block that was looked up could not be loaded (``failed_load_causes``)
MISSING = "missing"  # no longer there: evicted since the lookup, or its file removed
CHECKSUM = "checksum"  # the bytes read back do not match their checksum
FORMAT = "format"  # not a block file of this format, of this size, or of this block
NAMESPACE = "namespace"  # a block file of another tier: another model, layout or rank
IO = "io"  # the read failed (OSError)
DISABLED = "disabled"  # the tier was turned off (e.g. its directory vanished)
ERROR = "error"  # copying into the KV cache failed
FAILED_LOAD_CAUSES = (MISSING, CHECKSUM, FORMAT, NAMESPACE, IO, DISABLED, ERROR)


@dataclass
class TierStats:
    # lookups, in blocks (one per KV cache group): a block loaded from this tier is a hit
    # here and a miss in the tiers looked in before it; a block no tier holds is a miss in
    # every enabled tier
    lookups: int = 0  # hits + misses
    hits: int = 0
    misses: int = 0
    hit_tokens: float = 0.0  # prompt tokens whose KV was loaded from this tier
    prefill_saved_seconds: float = 0.0  # hit_tokens / the engine's measured prefill rate
    stored_blocks: int = 0
    bytes_stored: int = 0  # bytes written into this tier
    store_seconds: float = 0.0  # copying blocks out of the KV cache and into this tier
    loaded_blocks: int = 0  # blocks loaded intact into the KV cache
    bytes_loaded: int = 0  # bytes read back from this tier
    load_seconds: float = 0.0  # reading them and copying them into the KV cache
    skipped_stores: int = 0  # stores dropped: tier full, busy, disabled or a write error
    not_admitted: int = 0  # stores the admission policy turned down (first sighting)
    short_hits: int = 0  # blocks found here but recomputed: the hit was under min_load_tokens
    failed_loads: int = 0  # the sum of failed_load_causes
    failed_load_causes: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    wasted_blocks: int = 0  # blocks stored here that left it without ever being loaded
    skipped_files: int = 0  # disk: entries found that are not its regular files (left alone)
    # gauges
    unused_blocks: int = 0  # blocks stored here, still held, not loaded yet
    used_bytes: int = 0  # a shared disk directory: its namespace's, every instance's blocks
    capacity_bytes: int = 0
    used_blocks: int = 0
    capacity_blocks: int = 0  # the blocks the budget holds
    enabled: bool = True

    def as_dict(self) -> dict:
        return asdict(self)

    def record_failed_load(self, cause: str) -> None:
        self.failed_loads += 1
        self.failed_load_causes[cause] = self.failed_load_causes.get(cause, 0) + 1


# metric help: field -> text; the counters first, then the gauges
COUNTERS = {
    "lookups": "KV blocks looked up in this tier (hits + misses)",
    "hits": "KV blocks a prefix lookup found in this tier",
    "misses": "KV blocks a prefix lookup looked for in this tier and did not find",
    "hit_tokens": "Prompt tokens whose KV was loaded from this tier instead of computed",
    "prefill_saved_seconds": "Prefill time the loads from this tier saved: hit tokens / "
                             "the engine's measured prefill rate",
    "stored_blocks": "KV blocks written into this tier",
    "bytes_stored": "Bytes written into this tier",
    "store_seconds": "Seconds spent copying blocks out of the KV cache and into this tier",
    "loaded_blocks": "KV blocks loaded intact from this tier into the KV cache",
    "bytes_loaded": "Bytes loaded from this tier into the KV cache",
    "load_seconds": "Seconds spent reading blocks from this tier into the KV cache",
    "skipped_stores": "Stores dropped (tier full or busy, write error, tier disabled)",
    "not_admitted": "Stores the admission policy turned down",
    "short_hits": "KV blocks found in this tier but recomputed: the hit spared fewer prompt "
                  "tokens than the break-even length (min_load_tokens)",
    "failed_loads": "KV blocks that could not be loaded, by cause",
    "evictions": "KV blocks evicted from this tier",
    "wasted_blocks": "KV blocks stored in this tier that left it without ever being loaded",
    "skipped_files": "Entries of the disk tier's folder that are not its regular files "
                     "(directories, links), left alone",
}
GAUGES = {
    "unused_blocks": "KV blocks stored in this tier and not loaded yet",
    "used_bytes": "Bytes this tier holds now",
    "capacity_bytes": "This tier's byte budget",
    "used_blocks": "KV blocks this tier holds now",
    "capacity_blocks": "KV blocks this tier's budget holds",
    "enabled": "1 while this tier is in use (a failed disk turns it off)",
}
PREFILL_RATE = ("kvmem_prefill_tokens_per_second",
                "The engine's measured prefill rate (tokens computed per second of forward "
                "passes that compute prompt tokens), which values the tiers' hit tokens")


# For KV-aware routers weighing tiers: per tier, used and total, in bytes and in blocks
# (a disk directory shared by instances of a model: the namespace's figures, all of them)
CAPACITY = {
    "kvmem_tier_capacity_bytes": ("Bytes of each offload tier, used and total "
                                  "(kind=used|total)", "used_bytes", "capacity_bytes"),
    "kvmem_tier_capacity_blocks": ("KV blocks of each offload tier, used and total "
                                   "(kind=used|total)", "used_blocks", "capacity_blocks"),
}


def capacity_samples(figures: dict[str, float]) -> Iterator[tuple[str, str, str, float]]:
    """(metric, help, kind, value) of one tier's capacity gauges, from its figures
    (``TierStats`` fields by name)."""
    for metric, (doc, used, total) in CAPACITY.items():
        yield metric, doc, "used", float(figures.get(used, 0))
        yield metric, doc, "total", float(figures.get(total, 0))


def metric_name(field_name: str) -> str:
    return f"kvmem_offload_{field_name}"


def block_tokens(block_groups: Sequence[int], counted_groups: Collection[int],
                 block_size: int) -> list[float]:
    """The prompt tokens each loaded block stands for, given its KV cache group: a block
    position's tokens are shared by its blocks in the ``counted_groups`` (the full-attention
    groups, which hold every position, where the model has any); other groups' blocks
    stand for none. Summed over a load, the tokens whose KV it restored."""
    share = block_size / len(counted_groups)
    return [share if g in counted_groups else 0.0 for g in block_groups]


def prefill_step_tokens(scheduled_tokens: Iterable[int]) -> int:
    """The tokens a step computes when it computes prompt tokens (some request scheduled
    more than one token), else 0: a step of decodes alone says nothing of prefill speed."""
    counts = list(scheduled_tokens)
    return sum(counts) if any(n > 1 for n in counts) else 0


class PrefillMeter:
    """The engine's prefill rate, measured: tokens computed over the seconds of the
    forward passes that computed prompt tokens (steps of decodes alone are left out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens = 0
        self.seconds = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.tokens += tokens
                self.seconds += seconds

    def rate(self) -> float | None:
        """Tokens per second; None before any prefill was measured."""
        with self._lock:
            return self.tokens / self.seconds if self.seconds > 0 else None
