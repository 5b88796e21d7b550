"""Counters of one tier, exported on /metrics as ``kvmem_offload_*{tier=...}``."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    hits: int = 0  # blocks a prefix lookup found in this tier and will load from it
    misses: int = 0  # blocks a prefix lookup looked for here and did not find
    stored_blocks: int = 0
    bytes_stored: int = 0  # bytes written into this tier
    bytes_loaded: int = 0  # bytes read back from this tier into the KV pool
    skipped_stores: int = 0  # stores dropped: tier full, busy, disabled or a write error
    not_admitted: int = 0  # stores the admission policy turned down (first sighting)
    failed_loads: int = 0  # missing, damaged, of another namespace, or unreadable
    evictions: int = 0
    skipped_files: int = 0  # disk: entries found that are not its regular files (left alone)
    used_bytes: int = 0
    capacity_bytes: int = 0
    enabled: bool = True

    def as_dict(self) -> dict[str, int | bool]:
        return asdict(self)
