"""``KvmemConnector``'s settings, read from vLLM's ``kv_connector_extra_config``.

| key | meaning |
|---|---|
| ``cpu_offload_gib`` | CPU tier budget per worker, GiB (0 or absent: no CPU tier) |
| ``disk_offload_dir`` | directory of the disk tier (a namespace per model and rank inside) |
| ``disk_offload_gib`` | disk tier budget per worker, GiB |
| ``offload_policy`` | ``lru`` (default) or ``seen-twice`` (store a block on its second offer) |
| ``min_load_tokens`` | a tier hit sparing fewer prompt tokens is recomputed (default 0) |
| ``faults`` | injected faults (``kvmem.tiers.faults.Faults`` fields), for tests and drills |

Types are strict, as kvmem's HTTP API's are: a number of GiB is a JSON number (``"4"`` is
refused, not read as 4), a path a string. Every bad value is refused with one line naming
the key. Imports no vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.tiers.config import POLICIES, OffloadConfig, SettingNames
from kvmem.tiers.cpu_store import check_host_memory
from kvmem.tiers.disk_store import check_disk_budget
from kvmem.tiers.faults import Faults
from kvmem.units import GiB

KEYS = ("cpu_offload_gib", "disk_offload_dir", "disk_offload_gib", "offload_policy",
        "min_load_tokens", "faults")
PREFIX = "KvmemConnector: kv_connector_extra_config"


def setting(key: str) -> str:
    """How messages name a key: ``KvmemConnector: kv_connector_extra_config['key']``."""
    return f"{PREFIX}[{key!r}]"


NAMES = SettingNames(cpu_bytes=setting("cpu_offload_gib"), disk_dir=setting("disk_offload_dir"),
                     disk_bytes=setting("disk_offload_gib"),
                     min_load_tokens=setting("min_load_tokens"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TYPE_CHECKS = {  # the Faults fields' types, as strictly as the HTTP API checks them
    "float": _is_number,
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
}


def _gib(extra: Mapping[str, Any], key: str) -> float:
    value = extra.get(key, 0)
    if not _is_number(value):
        kind = " (a string: write the number without quotes)" if isinstance(value, str) else ""
        raise ConfigError(f"{setting(key)} must be a number of GiB, got {value!r}{kind}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{setting(key)} must be a non-negative number of GiB, "
                          f"got {value!r}")
    return float(value)


def _faults(value: Any) -> Faults:
    types = {f.name: f.type for f in fields(Faults) if not f.name.startswith("_")}
    if not isinstance(value, Mapping) or not set(value) <= set(types):
        raise ConfigError(f"{setting('faults')} must be an object with keys among "
                          f"{', '.join(sorted(types))}, got {value!r}")
    for name, given in value.items():
        if not _TYPE_CHECKS[types[name]](given):
            raise ConfigError(f"{setting('faults')}[{name!r}] must be a {types[name]}, "
                              f"got {given!r}")
    return Faults(**dict(value))


def _check_dir(path: str) -> None:
    """``path`` is a directory, or one this process may create. A directory it may not
    write in is accepted: the tier loads what is there and skips its stores, saying so in
    one line (a read-only volume that other instances filled)."""
    key = setting("disk_offload_dir")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{key} {path!r} is not a directory")
    if target.is_dir():
        return
    while not target.exists():  # it will be created: its nearest existing parent decides
        target = target.parent
    if not target.is_dir():
        raise ConfigError(f"{key} {path!r} cannot be created: {str(target)!r} is not a "
                          "directory")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {path!r} cannot be created: {str(target)!r} is not "
                          "writable by this process")


def _check_keys(extra: Mapping[str, Any]) -> None:
    unknown = sorted(set(extra) - set(KEYS), key=str)
    if unknown:
        raise ConfigError(f"{PREFIX}: unknown key {unknown[0]!r}; known keys: {', '.join(KEYS)}")


def parse_extra_config(extra: Mapping[str, Any] | None) -> tuple[OffloadConfig, Faults]:
    """The offload settings and injected faults of a ``kv_connector_extra_config``."""
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"{PREFIX} must be an object, got {extra!r}")
    extra = dict(extra or {})
    _check_keys(extra)
    cpu = _gib(extra, "cpu_offload_gib")
    disk = _gib(extra, "disk_offload_gib")
    disk_dir = extra.get("disk_offload_dir") or None
    if disk_dir is not None and not isinstance(disk_dir, str):
        raise ConfigError(f"{setting('disk_offload_dir')} must be a path, got {disk_dir!r}")
    policy = extra.get("offload_policy", "lru")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(f"{setting('offload_policy')} must be one of {', '.join(POLICIES)}, "
                          f"got {policy!r}")
    if disk and not disk_dir:
        raise ConfigError(f"{PREFIX}: 'disk_offload_gib' needs 'disk_offload_dir'")
    if disk_dir and not disk:
        raise ConfigError(f"{PREFIX}: 'disk_offload_dir' needs 'disk_offload_gib' (its budget)")
    if not cpu and not disk:
        raise ConfigError(f"{PREFIX}: set 'cpu_offload_gib' and/or 'disk_offload_gib' "
                          "(with 'disk_offload_dir'); both are 0")
    if disk_dir:
        _check_dir(disk_dir)
        check_disk_budget(int(disk * GiB), Path(disk_dir), NAMES)
    check_host_memory(int(cpu * GiB), setting("cpu_offload_gib"))
    config = OffloadConfig(cpu_bytes=int(cpu * GiB), disk_dir=disk_dir,
                           disk_bytes=int(disk * GiB), policy=policy,
                           min_load_tokens=extra.get("min_load_tokens", 0), names=NAMES)
    return config, _faults(extra.get("faults", {}))


def kv_transfer_config(**settings: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that turns ``KvmemConnector`` on with ``settings`` (the
    keys of the table above): ``vllm.LLM(..., kv_transfer_config=kv_transfer_config(
    cpu_offload_gib=4))``, or ``json.dumps`` of it for ``--kv-transfer-config``.

    Unknown keys are refused here; the values are checked when vLLM starts the engine
    (before it loads the model), where the directory and memory they name are.
    """
    _check_keys(settings)
    return {"kv_connector": "KvmemConnector",
            "kv_connector_module_path": "kvmem.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",  # a block a tier lost is recomputed
            "kv_connector_extra_config": settings}
