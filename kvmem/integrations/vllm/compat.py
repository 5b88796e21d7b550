"""What kvmem's vLLM integration needs from the installed vLLM, checked when it loads.

Each part names the vLLM objects it uses, and checks them against the installed vLLM
before it touches anything, instead of matching a version string:

- the plugin (``plugin.py``): the engine core's ``get_kv_cache_configs`` (the function it
  wraps) with its leading parameters ``vllm_config, kv_cache_specs, available_memory`` —
  any further parameters are forwarded untouched, such as the ``global_kv_cache_groups``
  vLLM 0.33 added — the worker's ``initialize_from_config``, and the helpers it calls;
- ``KvmemConnector``: the connector base class and every hook it implements, with the
  parameters vLLM passes them, and no abstract hook of the base class left unimplemented;
  the connector-stats classes its figures go through (and what their base keeps for it),
  and the KV event classes, their fields and the block-hash helpers its events use;
- elastic KV memory (``elastic``): the function the plugin wraps
  (``EngineArgs.create_engine_config``), ``KvmemElasticConnector``'s hooks, and inside
  vLLM the calls it relies on (the KV allocation's ``torch.zeros`` inside the connector's
  memory-pool context, ``handle_preemptions`` before the forward, ``has_pending_push_work``
  keeping the engine stepping) and the free-block queue methods ``BlockPool`` uses.

A missing or changed object stops that part with one line naming it (``require``); a
vLLM that has them all but is not a tested series works with a warning. ``report`` lists
every part with the reason it does not work, for ``kvmem vllm-check``. Imports no vLLM at
module level.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from kvmem.errors import ConfigError

TESTED_VLLM = ("0.32", "0.33")  # major.minor series the tests run against
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@dataclass(frozen=True)
class Need:
    """One vLLM object: ``module:qualified.name``, and the leading parameters (after
    ``self``) it must take, in order; ``exact``: no further parameter either (a hook
    vLLM calls on kvmem's override, which takes exactly these)."""

    path: str
    params: tuple[str, ...] | None = None
    exact: bool = False

    @property
    def dotted(self) -> str:
        return self.path.replace(":", ".")


# KvmemConnector's hooks and the parameters vLLM calls them with ("**" : it takes kwargs).
CONNECTOR_HOOKS: dict[str, tuple[str, ...]] = {
    # worker side
    "register_kv_caches": ("kv_caches",),
    "start_load_kv": ("forward_context", "**"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "**"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "build_connector_worker_meta": (),
    "shutdown": (),
    # scheduler side
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "has_pending_block_frees": (),
    # figures and events
    "bind_connector_metadata": ("connector_metadata",),
    "get_kv_connector_stats": (),
    "build_kv_connector_stats": ("data",),
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames",
                           "per_engine_labelvalues"),
    "take_events": (),
}
METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
KV_UTILS = "vllm.v1.core.kv_cache_utils"
# what KvmemPromMetrics reads from the base class vLLM's __init__ fills in
PROM_BASE_ATTRIBUTES = ("self._counter_cls", "self._gauge_cls", "self.per_engine_labelvalues")
# the fields of vLLM's KV events that KvmemConnector's events fill in
EVENT_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
}

PLUGIN_NEEDS = (
    Need("vllm.v1.engine.core:get_kv_cache_configs",
         ("vllm_config", "kv_cache_specs", "available_memory")),
    Need("vllm.v1.worker.gpu_worker:Worker.initialize_from_config", ("kv_cache_config",)),
    Need("vllm.distributed.utils:get_pp_indices", ("num_hidden_layers", "pp_rank", "pp_size")),
    Need("vllm.v1.core.kv_cache_utils:get_kv_cache_capacity",
         ("vllm_config", "kv_cache_config")),
    Need("vllm.distributed.parallel_state:get_pp_group"),
    Need("vllm.distributed.parallel_state:get_tp_group"),
    Need("vllm.logger:init_logger"),
)

FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory"
CONNECTOR_NEEDS = (
    Need(f"{BASE}:KVConnectorBase_V1.__init__", ("vllm_config", "role", "kv_cache_config"),
         exact=True),
    # named there, so that vLLM finds the class by name (MultiConnector's stats)
    Need(f"{FACTORY}.register_connector", ("name", "module_path", "class_name")),
    Need(f"{BASE}:KVConnectorBase_V1._get_connector_metadata", ()),
    Need(f"{BASE}:KVConnectorMetadata"),
    Need(f"{BASE}:KVConnectorWorkerMetadata.aggregate", ("other",)),
    Need(f"{BASE}:KVConnectorRole.SCHEDULER"),
    Need(f"{BASE}:SupportsHMA.request_finished_all_groups", ("request", "block_ids"),
         exact=True),
    Need("vllm.v1.metrics.cache_hit_source:CacheHitSource.HOST"),
    Need("vllm.v1.metrics.cache_hit_source:CacheHitSource.DISK"),
    Need("vllm.logger:init_logger"),
    *(Need(f"{BASE}:KVConnectorBase_V1.{hook}", params, exact=True)
      for hook, params in CONNECTOR_HOOKS.items()),
    Need(f"{METRICS}:KVConnectorStats.aggregate", ("other",), exact=True),
    Need(f"{METRICS}:KVConnectorStats.reduce", (), exact=True),
    Need(f"{METRICS}:KVConnectorStats.is_empty", (), exact=True),
    Need(f"{METRICS}:KVConnectorStats.reset", (), exact=True),
    Need(f"{METRICS}:KVConnectorStats.to_dict", (), exact=True),
    Need(f"{METRICS}:KVConnectorPromMetrics.__init__",
         ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"), exact=True),
    Need(f"{METRICS}:KVConnectorPromMetrics.observe", ("transfer_stats_data", "engine_idx"),
         exact=True),
    Need("vllm.distributed.kv_events:MEDIUM_CPU"),
    Need("vllm.distributed.kv_events:MEDIUM_STORAGE"),
    Need("vllm.distributed.kv_events:KVCacheEvent"),
    Need(f"{KV_UTILS}:maybe_convert_block_hash", ("hash_bytes",), exact=True),
    Need(f"{KV_UTILS}:generate_block_hash_extra_keys",
         ("request", "start_token_idx", "end_token_idx", "start_mm_idx"), exact=True),
    Need(f"{KV_UTILS}:to_event_extra_keys", ("extra_keys",), exact=True),
    Need(f"{KV_UTILS}:resolve_block_hashes", ("block_hashes", "hash_block_size", "block_size")),
)

# KvmemElasticConnector's hooks (elastic KV memory), as CONNECTOR_HOOKS above.
ELASTIC_HOOKS: dict[str, tuple[str, ...]] = {
    "get_mem_pool_context": (),
    "handle_preemptions": ("kv_connector_metadata",),
    "start_load_kv": ("forward_context", "**"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "**"),
    "wait_for_save": (),
    "bind_gpu_block_pool": ("gpu_block_pool",),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request", "block_ids"),
    "has_pending_push_work": (),
    "has_pending_block_frees": (),
    "shutdown": (),
}
# The free-block queue methods vLLM's BlockPool may call; ElasticBlockQueue has them all.
QUEUE_METHODS = ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n",
                 "get_all_free_blocks", "num_free_blocks")
# Where vLLM must call what elastic KV memory relies on: (function, what it must contain).
ELASTIC_CALLS = (
    ("vllm.v1.worker.gpu_worker:Worker.initialize_from_config", ".get_mem_pool_context()"),
    ("vllm.v1.worker.utils:allocate_kv_cache", "torch.zeros("),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model", ".handle_preemptions("),
    ("vllm.v1.core.sched.scheduler:Scheduler.has_requests", ".has_pending_push_work()"),
    # an idle engine is woken to give memory back (elastic/watch.py): its loop waits on
    # the input queue until has_work(), and takes WAKEUP as a no-op
    ("vllm.v1.engine.core:EngineCoreProc._process_input_queue", "self.has_work()"),
    ("vllm.v1.engine.core:EngineCoreProc._handle_client_request",
     "EngineCoreRequestType.WAKEUP"),
)

ELASTIC_NEEDS = (
    Need("vllm.engine.arg_utils:EngineArgs.create_engine_config"),
    Need("vllm.engine.arg_utils:EngineArgs.kv_transfer_config"),
    Need("vllm.config:KVTransferConfig"),
    Need("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiConnector"),
    Need(f"{BASE}:KVConnectorBase_V1.__init__", ("vllm_config", "role", "kv_cache_config"),
         exact=True),
    Need(f"{BASE}:KVConnectorMetadata"),
    Need(f"{BASE}:KVConnectorRole.SCHEDULER"),
    Need(f"{BASE}:SupportsHMA.request_finished_all_groups", ("request", "block_ids"),
         exact=True),
    Need("vllm.v1.core.block_pool:BlockPool.evict_blocks", ("block_ids",)),
    Need("vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue"),
    Need("vllm.v1.kv_cache_interface:KVCacheTensor"),
    Need("vllm.v1.kv_cache_interface:KVCacheSpec.max_memory_usage_bytes", ("vllm_config",)),
    Need("vllm.v1.worker.utils:allocate_kv_cache", ("kv_cache_config", "device")),
    Need("vllm.distributed.utils:get_pp_indices", ("num_hidden_layers", "pp_rank", "pp_size")),
    Need("vllm.logger:init_logger"),
    Need("vllm.v1.engine.core:EngineCoreProc.run_busy_loop"),
    Need("vllm.v1.engine:EngineCoreRequestType.WAKEUP"),
    *(Need(f"{BASE}:KVConnectorBase_V1.{hook}", params, exact=True)
      for hook, params in ELASTIC_HOOKS.items()),
)

FEATURES: dict[str, tuple[str, tuple[Need, ...]]] = {
    "plugin": ("per-rank KV budgets and fit check (KVMEM_VLLM_KV_BUDGET)", PLUGIN_NEEDS),
    "connector": ("KvmemConnector: CPU and disk KV tiers, tensor and pipeline parallel",
                  CONNECTOR_NEEDS),
    "elastic": ("elastic KV memory (KVMEM_VLLM_KV_MEMORY=elastic): KV pages mapped as "
                "vLLM's block pool needs them, under a limit engines share", ELASTIC_NEEDS),
}


class Missing(Exception):
    """What one need lacks, as one line."""


def _resolve(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure means: not usable
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise Missing(f"cannot import {module_name} ({type(exc).__name__}: {first})") from None
    done = module_name
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise Missing(f"{done}.{part} is missing")
        obj = getattr(obj, part)
        done = f"{done}.{part}"
    return obj


def _signature_names(fn: Callable[..., Any]) -> list[str]:
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            names.append("**")
        elif p.kind is p.VAR_POSITIONAL:
            names.append("*")
        else:
            names.append(p.name)
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def check_need(need: Need) -> None:
    """Raise ``Missing`` when vLLM lacks ``need`` or it takes other parameters."""
    obj = _resolve(need.path)
    if need.params is None:
        return
    try:
        names = _signature_names(obj)
    except (TypeError, ValueError):
        raise Missing(f"{need.dotted} has no signature to check") from None
    lead = list(need.params)
    if names[:len(lead)] != lead or (need.exact and names != lead):
        want = ", ".join(lead) + ("" if need.exact else ", ...")
        raise Missing(f"{need.dotted} takes ({', '.join(names)}), kvmem needs ({want})")


def _unimplemented_hooks() -> list[str]:
    base = _resolve(f"{BASE}:KVConnectorBase_V1")
    return sorted(set(getattr(base, "__abstractmethods__", ())) - set(CONNECTOR_HOOKS))


@functools.cache
def problems(feature: str) -> tuple[str, ...]:
    """Why ``feature`` ("plugin", "connector" or "elastic") cannot run on the installed
    vLLM."""
    found = []
    for need in FEATURES[feature][1]:
        try:
            check_need(need)
        except Missing as exc:
            found.append(str(exc))
    if feature == "connector" and not found:
        found += [f"{BASE}.KVConnectorBase_V1.{hook} is abstract and KvmemConnector does not "
                  "implement it" for hook in _unimplemented_hooks()]
        found += missing_calls(tuple((f"{METRICS}:KVConnectorPromMetrics.__init__", attribute)
                                     for attribute in PROM_BASE_ATTRIBUTES))
        found += _missing_event_fields()
    if feature == "elastic" and not found:
        found += _elastic_call_sites()
    return tuple(found)


def _missing_event_fields() -> list[str]:
    """One line per KV event class that lacks a field KvmemConnector's events fill in."""
    found = []
    for name, wanted in EVENT_FIELDS.items():
        try:
            event = _resolve(f"vllm.distributed.kv_events:{name}")
        except Missing as exc:
            found.append(str(exc))
            continue
        fields = set(getattr(event, "__struct_fields__", ()))
        if missing := [f for f in wanted if f not in fields]:
            found.append(f"vllm.distributed.kv_events.{name} has no field {missing[0]}")
    return found


def _elastic_call_sites() -> list[str]:
    """What elastic KV memory relies on inside vLLM's functions: the calls it hooks into,
    and a block pool that uses no free-block queue method kvmem's queue lacks."""
    found = missing_calls(ELASTIC_CALLS)
    try:
        tensor = _resolve("vllm.v1.kv_cache_interface:KVCacheTensor")
        pool = inspect.getsource(_resolve("vllm.v1.core.block_pool:BlockPool"))
    except Missing as exc:
        return [*found, str(exc)]
    except (OSError, TypeError):
        return [*found, "vllm.v1.core.block_pool.BlockPool has no source to check"]
    fields = {f.name for f in dataclass_fields(tensor)}
    if missing := {"size", "layers", "layer_stride", "block_stride"} - fields:
        found.append(f"vllm.v1.kv_cache_interface.KVCacheTensor has no {sorted(missing)[0]}")
    used = set(re.findall(r"free_block_queue\.(\w+)", pool))
    if unknown := sorted(used - set(QUEUE_METHODS)):
        found.append(f"vllm.v1.core.block_pool.BlockPool calls free_block_queue.{unknown[0]}, "
                     "which kvmem's page-aware queue does not have")
    return found


def missing_calls(calls: tuple[tuple[str, str], ...]) -> list[str]:
    """For each (function, call): one line when the function is gone, has no Python source,
    or no longer contains the call."""
    found = []
    for path, call in calls:
        dotted = path.replace(":", ".")
        try:
            source = inspect.getsource(_resolve(path))
        except Missing as exc:
            found.append(str(exc))
        except (OSError, TypeError):  # compiled, or not a function
            found.append(f"{dotted} has no source to check for {call}")
        else:
            if call not in source:
                found.append(f"{dotted} no longer calls {call}")
    return found


def vllm_import_error() -> str | None:
    """Why ``import vllm`` fails here, in one line (its exception, or the exit it called
    while importing); None when it imports."""
    try:
        import vllm  # noqa: F401
    except SystemExit as exc:  # some builds exit when they find no usable device
        return f"importing vllm called sys.exit({exc.code!r})"
    except Exception as exc:  # noqa: BLE001 - not installed, or broken: both mean no vLLM
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    return None


def vllm_version() -> str | None:
    """The installed vLLM's version, None when vLLM cannot be imported."""
    if vllm_import_error() is not None:
        return None
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def tested(version: str) -> bool:
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) in TESTED_VLLM


def require(feature: str) -> str:
    """vLLM's version when ``feature`` can run on it; ConfigError (one line) otherwise."""
    error = vllm_import_error()
    if error is not None:
        raise ConfigError(f"kvmem's vLLM {feature} needs vLLM, which cannot be imported here "
                          f"({error})")
    version = vllm_version()
    found = problems(feature)
    if found:
        more = f" (and {len(found) - 1} more; see `kvmem vllm-check`)" if len(found) > 1 else ""
        raise ConfigError(f"kvmem's vLLM {feature} cannot run on vLLM {version}: "
                          f"{found[0]}{more}")
    return version


def untested_warning(version: str) -> str | None:
    """A one-line warning for a vLLM that passes the checks but is not a tested series."""
    if tested(version):
        return None
    series = ", ".join(f"{s}.x" for s in TESTED_VLLM)
    return (f"kvmem's vLLM integration is tested with vLLM {series}; vLLM {version} has "
            "everything it checks for, so it runs")


@dataclass(frozen=True)
class FeatureStatus:
    name: str
    description: str
    works: bool
    reasons: tuple[str, ...]


def device_type() -> str | None:
    """vLLM's platform here ("cpu", "cuda", ...), None when it finds none."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type) or None
    except (Exception, SystemExit):  # noqa: BLE001 - no usable platform
        return None


def report() -> tuple[str | None, list[FeatureStatus]]:
    """The installed vLLM's version and, for each part of the integration, whether it
    works and why not."""
    error = vllm_import_error()
    if error is not None:
        return None, [FeatureStatus(name, desc, False, (f"vLLM cannot be imported ({error})",))
                      for name, (desc, _) in FEATURES.items()]
    version = vllm_version()
    statuses = []
    for name, (desc, _) in FEATURES.items():
        found = problems(name)
        statuses.append(FeatureStatus(name, desc, not found, found))
    device = device_type()
    layout_ok = device in ("cpu", "cuda")
    statuses.append(FeatureStatus(
        "connector-kv-layout", "KvmemConnector's workers on this platform's KV tensors",
        layout_ok, () if layout_ok else (
            f"vLLM's platform here is {device or 'none (no device found)'}; the workers copy "
            "KV blocks between host memory and CPU or CUDA KV tensors only",)))
    return version, statuses


NOTES = (
    "sleep mode (enable_sleep_mode) with KvmemConnector is refused at start-up: weights "
    "replaced while the engine sleeps would meet KV the tiers cached for the old ones",
)
