"""``KvmemConnector``'s settings, read from vLLM's ``kv_connector_extra_config``.

| key | meaning |
|---|---|
| ``cpu_offload_gib`` | CPU tier budget per worker, GiB (0 or absent: no CPU tier) |
| ``disk_offload_dir`` | directory of the disk tier (a namespace per model and rank inside) |
| ``disk_offload_gib`` | disk tier budget per worker, GiB |
| ``offload_policy`` | ``lru`` (default) or ``seen-twice`` (store a block on its second offer) |
| ``faults`` | injected faults (``kvmem.tiers.faults.Faults`` fields), for tests and drills |

Every bad value is refused with one line naming the key. Imports no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvmem.errors import ConfigError
from kvmem.tiers.config import POLICIES, OffloadConfig
from kvmem.tiers.faults import Faults
from kvmem.units import GiB

KEYS = ("cpu_offload_gib", "disk_offload_dir", "disk_offload_gib", "offload_policy", "faults")
PREFIX = "KvmemConnector: kv_connector_extra_config"


def _gib(extra: Mapping[str, Any], key: str) -> float:
    value = extra.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{PREFIX}[{key!r}] must be a number of GiB, got {value!r}")
    try:
        gib = float(value)
    except ValueError:
        raise ConfigError(f"{PREFIX}[{key!r}] must be a number of GiB, got {value!r}") from None
    if not math.isfinite(gib) or gib < 0:
        raise ConfigError(f"{PREFIX}[{key!r}] must be a non-negative number of GiB, "
                          f"got {value!r}")
    return gib


def _faults(value: Any) -> Faults:
    names = {f.name for f in fields(Faults) if not f.name.startswith("_")}
    if not isinstance(value, Mapping) or not set(value) <= names:
        raise ConfigError(f"{PREFIX}['faults'] must be an object with keys among "
                          f"{', '.join(sorted(names))}, got {value!r}")
    try:
        return Faults(**dict(value))
    except TypeError as exc:
        raise ConfigError(f"{PREFIX}['faults']: {exc}") from None


def parse_extra_config(extra: Mapping[str, Any] | None) -> tuple[OffloadConfig, Faults]:
    """The offload settings and injected faults of a ``kv_connector_extra_config``."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ConfigError(f"{PREFIX}: unknown key {unknown[0]!r}; known keys: {', '.join(KEYS)}")
    cpu = _gib(extra, "cpu_offload_gib")
    disk = _gib(extra, "disk_offload_gib")
    disk_dir = extra.get("disk_offload_dir") or None
    if disk_dir is not None and not isinstance(disk_dir, str):
        raise ConfigError(f"{PREFIX}['disk_offload_dir'] must be a path, got {disk_dir!r}")
    policy = extra.get("offload_policy", "lru")
    if policy not in POLICIES:
        raise ConfigError(f"{PREFIX}['offload_policy'] must be one of {', '.join(POLICIES)}, "
                          f"got {policy!r}")
    if disk and not disk_dir:
        raise ConfigError(f"{PREFIX}: 'disk_offload_gib' needs 'disk_offload_dir'")
    if disk_dir and not disk:
        raise ConfigError(f"{PREFIX}: 'disk_offload_dir' needs 'disk_offload_gib' (its budget)")
    if not cpu and not disk:
        raise ConfigError(f"{PREFIX}: set 'cpu_offload_gib' and/or 'disk_offload_gib' "
                          "(with 'disk_offload_dir'); both are 0")
    config = OffloadConfig(cpu_bytes=int(cpu * GiB), disk_dir=disk_dir,
                           disk_bytes=int(disk * GiB), policy=policy)
    return config, _faults(extra.get("faults", {}))
