"""Offload settings and the identity that namespaces a disk tier.

``OffloadConfig`` is what the user states (``--cpu-offload-gib``, ``--disk-offload-dir``,
``--disk-offload-gib``). ``TierIdentity`` is what makes stored blocks reusable: two
processes share a disk tier only when model, layout, KV dtype and block size all agree,
so the directory of a tier is named by a digest of exactly those.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

from kvmem.errors import ConfigError
from kvmem.units import GiB, MiB, format_bytes

POLICIES = ("lru", "seen-twice")
FORMAT_VERSION = 2  # bump when the on-disk block format changes (2: bound to its namespace)
# A disk entry is the file header (kvmem.tiers.disk_store), the key's name ("g<group>-" and
# 32 hex digits for groups 0-9) and the block's bytes.
DISK_ENTRY_OVERHEAD_BYTES = 56 + 35


@dataclass(frozen=True)
class SettingNames:
    """How errors name the offload settings: kvmem's flags, or in ``KvmemConnector`` the
    keys of vLLM's ``kv_connector_extra_config``."""

    cpu_bytes: str = "--cpu-offload-gib"
    disk_dir: str = "--disk-offload-dir"
    disk_bytes: str = "--disk-offload-gib"
    min_load_tokens: str = "--offload-min-load-tokens"


FLAG_NAMES = SettingNames()


@dataclass(frozen=True)
class OffloadConfig:
    """Byte budgets of the CPU and disk tiers; a budget of 0 turns that tier off."""

    cpu_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    policy: str = "lru"
    # Most blocks held by stores still copying out of the pool; beyond it a store is skipped
    # so that offloading can never starve allocation.
    max_inflight_store_blocks: int = 4096
    # Host rows (pinned on CUDA) carrying blocks the CPU tier does not hold to the disk
    # writer: a store waits for one to be free (STAGING_WAIT_S at most), then skips the disk.
    staging_bytes: int = 512 * MiB
    # A tier hit that would spare the request fewer prompt tokens than this is recomputed
    # instead of loaded: on a fast device a short prefill beats a copy over the host link
    # (0: every hit loads).
    min_load_tokens: int = 0
    names: SettingNames = FLAG_NAMES
    # False: the directory is a name in a plan for another machine, never looked at here
    # (kvmem ui: a remote user must not learn which paths exist on the server)
    check_dir: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError("offload budgets must not be negative")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown offload policy {self.policy!r}; choose one of "
                              f"{', '.join(POLICIES)}")
        if self.disk_bytes and not self.disk_dir:
            raise ConfigError("--disk-offload-gib needs --disk-offload-dir")
        if self.disk_dir and not self.disk_bytes:
            raise ConfigError("--disk-offload-dir needs --disk-offload-gib (its byte budget)")
        if self.max_inflight_store_blocks < 1:
            raise ConfigError("max_inflight_store_blocks must be at least 1")
        if self.staging_bytes < 1:
            raise ConfigError("staging_bytes must be at least 1")
        if isinstance(self.min_load_tokens, bool) or not isinstance(self.min_load_tokens, int) \
                or self.min_load_tokens < 0:
            raise ConfigError(f"{self.names.min_load_tokens} must be a whole number of tokens, "
                              f"0 or more, got {self.min_load_tokens!r}")
        if self.disk_dir and self.check_dir:
            check_disk_dir(self.disk_dir, self.names)

    @classmethod
    def from_gib(cls, cpu_offload_gib: float = 0.0, disk_offload_dir: str | None = None,
                 disk_offload_gib: float = 0.0, policy: str = "lru",
                 check_dir: bool = True, min_load_tokens: int = 0) -> OffloadConfig:
        """Build from the CLI's GiB values (negative or non-finite values are rejected)."""
        for flag, value in (("--cpu-offload-gib", cpu_offload_gib),
                            ("--disk-offload-gib", disk_offload_gib)):
            if not value >= 0 or value == float("inf"):
                raise ConfigError(f"{flag} must be a non-negative number of GiB, got {value!r}")
        return cls(cpu_bytes=int(cpu_offload_gib * GiB), disk_dir=disk_offload_dir,
                   disk_bytes=int(disk_offload_gib * GiB), policy=policy, check_dir=check_dir,
                   min_load_tokens=min_load_tokens)

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.disk_bytes > 0

    def describe(self) -> str:
        """One line for `kvmem plan` and engine start-up logs."""
        parts = []
        if self.cpu_bytes:
            parts.append(f"CPU {format_bytes(self.cpu_bytes)}")
        if self.disk_bytes:
            parts.append(f"disk {format_bytes(self.disk_bytes)} in {self.disk_dir}")
        if not parts:
            return "off"
        below = f", hits under {self.min_load_tokens} tokens recomputed" \
            if self.min_load_tokens else ""
        return ", ".join(parts) + f" ({self.policy}{below})"


def check_disk_dir(path: str, names: SettingNames = FLAG_NAMES) -> None:
    """``path`` is a directory, or one that can be created: a file there (or in its place
    on the way to it) is refused before anything is planned or loaded."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{names.disk_dir} {path} is not a directory")
    while not target.exists() and target != target.parent:  # its nearest existing parent
        target = target.parent
    if not target.is_dir():
        raise ConfigError(f"{names.disk_dir} {path} cannot be created: {target} is not a "
                          "directory")


@dataclass(frozen=True)
class TierIdentity:
    """What a stored block depends on besides its tokens.

    ``model`` names the weights (architecture, model dtype and a digest of the weight files,
    ``kvmem.tiers.weights``); ``layout`` names this rank's share (tensor/pipeline rank,
    its layers and KV groups). The slot shape and dtype come from the KV storage itself,
    so a different head count or block size can never read another layout's blocks.
    """

    model: str
    layout: str
    kv_dtype: str
    block_size: int
    slot_shape: tuple[int, ...]  # one block of one slot tensor
    num_slots: int

    def digest(self) -> str:
        return self.digest_bytes().hex()

    def digest_bytes(self) -> bytes:
        """The 16-byte digest every disk block file of this identity carries."""
        record = {**asdict(self), "format": FORMAT_VERSION}
        return xxhash.xxh3_128_digest(json.dumps(record, sort_keys=True).encode())

    def namespace_dir(self, root: str | Path) -> Path:
        return Path(root) / f"kvmem-{self.digest()[:24]}"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "format": FORMAT_VERSION}, indent=2, sort_keys=True)


@dataclass(frozen=True)
class TierCapacity:
    """What one tier's budget holds for one model and layout."""

    tier: str  # "cpu" or "disk"
    budget_bytes: int
    block_nbytes: int  # bytes of one block in this tier (a disk block includes its header)
    num_blocks: int
    num_tokens: int


def tier_capacity(config: OffloadConfig, block_nbytes: int,
                  block_size: int) -> list[TierCapacity]:
    """How many blocks and tokens each enabled tier holds when a block is ``block_nbytes``
    bytes in the KV pool (every rank's share of it, for a parallel engine)."""
    if block_nbytes < 1:
        return []
    tiers = []
    for tier, budget, entry in (("cpu", config.cpu_bytes, block_nbytes),
                                ("disk", config.disk_bytes,
                                 block_nbytes + DISK_ENTRY_OVERHEAD_BYTES)):
        if budget:
            blocks = budget // entry
            tiers.append(TierCapacity(tier, budget, entry, blocks, blocks * block_size))
    return tiers
