"""Elastic KV memory in vLLM: its settings, from the environment to vLLM's connector config.

- ``KVMEM_VLLM_KV_MEMORY``: ``elastic`` turns it on; unset or empty: kvmem does nothing.
- ``KVMEM_VLLM_KV_MEMORY_MAX`` (or ``KVMEM_VLLM_KV_MEMORY_LIMIT``): the engine's ceiling,
  the most KV bytes it maps at once (``512MiB``, ``4GiB``); default: all of vLLM's KV cache
  (``kv_cache_memory_bytes``), which is the reservation.
- ``KVMEM_VLLM_KV_MEMORY_MIN``: the engine's floor, reserved for it whatever other engines
  on the device do (default 0).
- ``KVMEM_VLLM_KV_MEMORY_HUGE_PAGES``: ``1`` maps KV pages (on vLLM's CPU build) as whole
  transparent huge pages, which the kernel releases over ten times faster when another
  engine asks; needs the host's ``shmem_enabled`` at ``advise`` (``kvmem.memory.huge_pages``).
- ``KVMEM_VLLM_ENGINE_NAME``: the engine's name in the ledger (``kvmem top``,
  ``kvmem limit NAME``); default ``vllm-<model>-<pid>``.
- ``KVMEM_LEDGER_DIR``: where the ledger lives, as for kvmem's own engine (default
  ``/dev/shm``).
- ``KVMEM_VLLM_KV_MEMORY_FAULTS``: injected faults for drills and tests, JSON:
  ``{"map_error_rank": 1, "map_error_block": 100}`` makes rank 1 fail to map any block
  from 100 on, as if its device ran out of memory there.

The plugin reads them once, in the process that builds vLLM's configuration, and hands
them to every process through vLLM's KV transfer config (``kv_connector_extra_config`` of
``KvmemElasticConnector``), so the engine core and the workers see the same values.
Every bad value is one line. What can only be checked against the model (a ceiling
below one request of ``max_model_len``, a ledger folder where no ledger can be made) is
checked by ``check_deployment`` when vLLM builds its configuration, before any engine
process starts. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.memory.ledger import check_engine_name
from kvmem.units import format_bytes, parse_size

MODE_ENV = "KVMEM_VLLM_KV_MEMORY"
LIMIT_ENV = "KVMEM_VLLM_KV_MEMORY_LIMIT"
MAX_ENV = "KVMEM_VLLM_KV_MEMORY_MAX"
MIN_ENV = "KVMEM_VLLM_KV_MEMORY_MIN"
NAME_ENV = "KVMEM_VLLM_ENGINE_NAME"
HUGE_ENV = "KVMEM_VLLM_KV_MEMORY_HUGE_PAGES"
FAULTS_ENV = "KVMEM_VLLM_KV_MEMORY_FAULTS"
LEDGER_ENV = "KVMEM_LEDGER_DIR"

CONNECTOR = "KvmemElasticConnector"
CONNECTOR_MODULE = "kvmem.integrations.vllm.elastic.connector"
PREFIX = "KvmemElasticConnector: kv_connector_extra_config"


@dataclass(frozen=True)
class ElasticSettings:
    engine_name: str
    limit_bytes: int | None = None  # the ceiling; None: the whole reservation
    floor_bytes: int | None = None  # reserved for it under the device total
    ledger_dir: str | None = None  # None: $KVMEM_LEDGER_DIR or /dev/shm
    map_error_rank: int | None = None  # injected: this rank cannot map...
    map_error_block: int | None = None  # ...any block from this one on (None: 0)
    huge_pages: bool | None = None  # CPU pages of whole transparent huge pages

    def to_extra(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def elastic_from_env(model: str,
                     environ: Mapping[str, str] | None = None) -> ElasticSettings | None:
    """The settings the environment asks for; None when elastic KV memory is off.

    ``model`` names the engine by default (its last path part and this process id)."""
    env = os.environ if environ is None else environ
    mode = env.get(MODE_ENV, "").strip()
    others = [name for name in (LIMIT_ENV, MAX_ENV, MIN_ENV, NAME_ENV, FAULTS_ENV, HUGE_ENV)
              if env.get(name, "").strip()]
    if not mode:
        if others:
            raise ConfigError(f"{others[0]} is set but {MODE_ENV} is not; set "
                              f"{MODE_ENV}=elastic to use it")
        return None
    if mode != "elastic":
        raise ConfigError(f"{MODE_ENV}={mode!r}: the only value is 'elastic' (or leave it unset)")
    limits = {n: parse_size(env[n].strip(), n) for n in (LIMIT_ENV, MAX_ENV)
              if env.get(n, "").strip()}
    if len(set(limits.values())) > 1:
        raise ConfigError(f"{MAX_ENV} and {LIMIT_ENV} name the same ceiling; set one of them")
    limit = next(iter(limits.values()), None)
    floor_text = env.get(MIN_ENV, "").strip()
    floor = parse_size(floor_text, MIN_ENV) if floor_text else None
    if floor is not None and limit is not None and floor > limit:
        raise ConfigError(f"{MIN_ENV}={floor_text} is above the ceiling "
                          f"({next(iter(limits))}={env[next(iter(limits))].strip()})")
    name = env.get(NAME_ENV, "").strip() or default_engine_name(model)
    check_engine_name(name)
    faults = _faults(env.get(FAULTS_ENV, "").strip())
    return ElasticSettings(engine_name=name, limit_bytes=limit, floor_bytes=floor,
                           ledger_dir=env.get(LEDGER_ENV, "").strip() or None,
                           huge_pages=_switch(HUGE_ENV, env.get(HUGE_ENV, "")) or None,
                           **faults)


def _switch(name: str, text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "on", "yes"):
        return True
    if word in ("", "0", "false", "off", "no"):
        return False
    raise ConfigError(f"{name}={text!r}: expected 1 or 0")


def default_engine_name(model: str) -> str:
    base = Path(str(model).rstrip("/")).name or str(model)
    return f"vllm-{base}-{os.getpid()}"


def _faults(text: str) -> dict[str, int]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    keys = {"map_error_rank", "map_error_block"}
    if (not isinstance(value, dict) or not set(value) <= keys
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       for v in value.values())):
        raise ConfigError(f"{FAULTS_ENV}={text!r}: expected a JSON object with non-negative "
                          f"integers for {', '.join(sorted(keys))}")
    return value


def settings_from_extra(extra: Mapping[str, Any] | None) -> ElasticSettings:
    """The settings the plugin put in ``kv_connector_extra_config``, checked again (a
    hand-written ``--kv-transfer-config`` may name the connector too)."""
    extra = dict(extra or {})
    known = set(ElasticSettings.__dataclass_fields__)
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"{PREFIX}: unknown key {unknown[0]!r}; known keys: "
                          f"{', '.join(sorted(known))}")
    name = extra.get("engine_name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{PREFIX}['engine_name'] must be a non-empty string, got {name!r}")
    check_engine_name(name)
    limit = extra.get("limit_bytes")
    if limit is not None:
        limit = parse_size(limit, f"{PREFIX}['limit_bytes']")
    floor = extra.get("floor_bytes")
    if floor is not None:
        floor = parse_size(floor, f"{PREFIX}['floor_bytes']")
    for key in ("map_error_rank", "map_error_block"):
        value = extra.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"{PREFIX}[{key!r}] must be a non-negative integer, got {value!r}")
    huge = extra.get("huge_pages")
    if huge is not None and not isinstance(huge, bool):
        raise ConfigError(f"{PREFIX}['huge_pages'] must be true or false, got {huge!r}")
    return ElasticSettings(engine_name=name, limit_bytes=limit, floor_bytes=floor,
                           ledger_dir=extra.get("ledger_dir"),
                           map_error_rank=extra.get("map_error_rank"),
                           map_error_block=extra.get("map_error_block"), huge_pages=huge or None)


def with_elastic(kv_transfer: Mapping[str, Any] | None,
                 settings: ElasticSettings) -> dict[str, Any]:
    """The KV transfer config vLLM gets: kvmem's elastic connector alone, or with the
    connector(s) the user configured, through vLLM's ``MultiConnector`` (elastic first:
    it holds the KV cache's memory; the user's connectors load and store as before)."""
    ours = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_connector_extra_config": settings.to_extra()}
    user = {k: v for k, v in dict(kv_transfer or {}).items() if v is not None}
    if not user.get("kv_connector"):
        return ours
    if user["kv_connector"] == CONNECTOR:
        raise ConfigError(f"{CONNECTOR} is added by {MODE_ENV}=elastic; leave it out of "
                          "--kv-transfer-config")
    if user["kv_connector"] == "MultiConnector":
        extra = dict(user.get("kv_connector_extra_config") or {})
        children = list(extra.get("connectors") or [])
        if any(c.get("kv_connector") == CONNECTOR for c in children):
            raise ConfigError(f"{CONNECTOR} is added by {MODE_ENV}=elastic; leave it out of "
                              "--kv-transfer-config")
        return {**user, "kv_connector_extra_config": {**extra, "connectors": [ours, *children]}}
    # Settings that vLLM reads from the top-level config stay there (and with the child).
    top = {"kv_role": "kv_both", **{k: user[k] for k in ("kv_role", "kv_load_failure_policy")
                                    if k in user}}
    return {**top, "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [ours, user]}}


def ledger_device(device_type: str) -> str:
    """The ledger an engine on vLLM's ``device_type`` uses: ``cpu``, or its first GPU's."""
    return "cpu" if device_type == "cpu" else f"{device_type}:0"


def check_deployment(vllm_config: Any, settings: ElasticSettings) -> None:
    """What the settings need of the deployment, checked when vLLM builds its config (a
    one-line ConfigError): a ledger can be made where ``KVMEM_LEDGER_DIR`` points, and the
    ceiling holds one request of ``max_model_len`` on the ledger's device (every rank's
    KV on a CPU, rank 0's on a GPU; kvmem's plan of the deployment, which the engine core
    checks again, exactly, in vLLM's own blocks), and huge pages, when asked for, are
    to be had (vLLM's CPU build, whose KV lives in memory files)."""
    from kvmem.memory.huge_pages import huge_pages_problem
    from kvmem.memory.ledger import Ledger

    device_type = vllm_config.device_config.device_type
    if settings.huge_pages:
        if device_type != "cpu":
            raise ConfigError(f"{HUGE_ENV}=1 is for vLLM's CPU build; {device_type}'s pages "
                              "are the driver's granules already")
        problem = huge_pages_problem(shared=True)
        if problem:
            raise ConfigError(f"{HUGE_ENV}=1: {problem}")
    Ledger.for_device(ledger_device(device_type), settings.ledger_dir).read()
    if settings.limit_bytes is None:
        return
    need = request_bytes(vllm_config, every_rank=device_type == "cpu")
    if settings.limit_bytes < need:
        raise ConfigError(
            f"{LIMIT_ENV}={format_bytes(settings.limit_bytes)} is below one request of "
            f"max_model_len {vllm_config.model_config.max_model_len:,} "
            f"({format_bytes(need)} of KV); raise it or lower max_model_len")


def request_bytes(vllm_config: Any, *, every_rank: bool) -> int:
    """KV bytes one request of ``max_model_len`` needs: on rank 0, or on all ranks."""
    from kvmem.integrations.vllm.deployment import deployment_plan

    plan = deployment_plan(vllm_config)
    ranks = plan.ranks if every_rank else plan.ranks[:1]
    return sum(r.need_bytes_at_max_model_len for r in ranks)
