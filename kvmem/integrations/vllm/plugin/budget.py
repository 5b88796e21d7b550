"""The plugin's budget part: every rank's KV budget from :func:`kvmem.plan.plan`, and
kvmem's fit check.

:func:`install_budgets` (called by the plugin's ``register`` in every vLLM process) is
inert unless ``KVMEM_VLLM_KV_BUDGET`` names a budget policy
(``uniform``, ``proportional`` or ``optimal``); then it checks that vLLM has what it wraps
(``compat.require``: one line naming anything missing) and wraps two vLLM functions:

- the engine core's ``get_kv_cache_configs``: kvmem plans the real deployment (the model's
  config, tp, pp and the layer partition vLLM uses, ``kv_cache_memory_bytes`` or the KV
  memory each worker measured, the KV dtype and block size of the layers' KV specs) by the
  running vLLM's own rules (``kvmem.plan.vllm_rules``: its KV cache groups, what it charges
  a request, its batches in flight and hybrid manager setting), runs
  its per-rank fit check (an error naming the rank, its need, its budget and the longest
  context that fits), and hands each worker's KV budget to vLLM in place of the memory the
  worker reported; every other argument (vLLM 0.33's ``global_kv_cache_groups``) is passed
  on as it came. vLLM then sizes blocks as it always does;
- the worker's ``initialize_from_config``: each rank logs one line with the KV bytes,
  blocks and tokens it allocated.
"""

from __future__ import annotations

import inspect
import logging
import os
from functools import wraps
from typing import Any

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.deployment import deployment_plan
from kvmem.plan import POLICIES, Plan, RankProfile
from kvmem.plan.flags import PLUGIN_POLICY_ENV
from kvmem.plan.types import rank_label

ENV = PLUGIN_POLICY_ENV  # KVMEM_VLLM_KV_BUDGET
_MARK = "_kvmem_wrapped"



def policy_from_env() -> str | None:
    """The policy ``KVMEM_VLLM_KV_BUDGET`` names, None when unset; ConfigError otherwise."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value not in POLICIES:
        raise ConfigError(f"{ENV}={value!r}: choose one of {', '.join(POLICIES)} "
                          "(or leave it unset)")
    return value


def install_budgets() -> None:
    """Wrap vLLM's ``get_kv_cache_configs`` and the worker's ``initialize_from_config``
    when ``KVMEM_VLLM_KV_BUDGET`` names a policy; nothing otherwise. Idempotent."""
    policy = policy_from_env()
    if policy is None:
        return
    from kvmem.integrations.vllm import compat

    version = compat.require("plugin")
    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_worker  # CPUWorker inherits initialize_from_config

    if not getattr(core.get_kv_cache_configs, _MARK, False):
        if warning := compat.untested_warning(version):
            _logger().warning("kvmem: %s", warning)
        core.get_kv_cache_configs = with_kvmem_budgets(core.get_kv_cache_configs, policy)
    worker = gpu_worker.Worker
    if not getattr(worker.initialize_from_config, _MARK, False):
        worker.initialize_from_config = _logged(worker.initialize_from_config)


# ---------------------------------------------------------------------- engine core
def with_kvmem_budgets(get_kv_cache_configs: Any, policy: str) -> Any:
    """``get_kv_cache_configs`` that first plans with kvmem, checks every rank's fit and
    gives each worker its planned KV budget; the arguments it does not use are passed on
    as they came, by position or by name."""
    signature = inspect.signature(get_kv_cache_configs)

    @wraps(get_kv_cache_configs)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        vllm_config = call.arguments["vllm_config"]
        kv_cache_specs = call.arguments["kv_cache_specs"]
        if any(kv_cache_specs):  # an attention-free model has nothing to size
            kv_plan = plan_deployment(vllm_config, kv_cache_specs,
                                      call.arguments["available_memory"], policy)
            if vllm_config.model_config.original_max_model_len != -1:  # -1: vLLM fits it
                kv_plan.check_fit()
            call.arguments["available_memory"] = [r.kv_budget_bytes for r in kv_plan.ranks]
        return get_kv_cache_configs(*call.args, **call.kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def plan_deployment(vllm_config: Any, kv_cache_specs: list[dict], available_memory: list[int],
                    policy: str) -> Plan:
    """kvmem's plan for the deployment vLLM is starting; one rank per worker, in order."""
    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if len(kv_cache_specs) != tp * pp:
        raise ConfigError(f"{ENV}: {len(kv_cache_specs)} workers for tp {tp} x pp {pp} "
                          "(data or context parallel layouts are not planned)")
    # the KV block size and dtype are the attention layers': a hybrid's state layers
    # (MambaSpec) carry state dtypes, and without prefix caching a request-long block
    specs = [s for worker in kv_cache_specs for s in worker.values()]
    layer_spec = next((s for s in specs if hasattr(s, "dtype")), specs[0])
    # Without a stated value, what each worker measured is all it may use for KV.
    measured = None if vllm_config.cache_config.kv_cache_memory_bytes is not None else \
        [_kv_only(m) for m in available_memory]
    return deployment_plan(vllm_config, block_size=layer_spec.block_size,
                           layer_dtype=getattr(layer_spec, "dtype", None), policy=policy,
                           profile=measured)


def _kv_only(kv_bytes: int) -> RankProfile:
    return RankProfile(weights_bytes=0, activation_bytes=0, non_torch_bytes=0,
                       cuda_graph_bytes=0, total_bytes=max(1, kv_bytes))


# ---------------------------------------------------------------------- workers
def _logged(initialize_from_config: Any) -> Any:
    @wraps(initialize_from_config)
    def wrapper(self: Any, kv_cache_config: Any) -> None:
        initialize_from_config(self, kv_cache_config)
        _log_rank(self.vllm_config, kv_cache_config)

    setattr(wrapper, _MARK, True)
    return wrapper


def _log_rank(vllm_config: Any, kv_cache_config: Any) -> None:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    tp = vllm_config.parallel_config.tensor_parallel_size
    rank = get_pp_group().rank_in_group * tp + get_tp_group().rank_in_group
    # every KVCacheTensor places its layers in the worker's one allocation of ``size``
    # bytes (a hybrid's state and attention groups overlay it): count it once
    kv_bytes = max(t.size for t in kv_cache_config.kv_cache_tensors)
    tokens, _ = get_kv_cache_capacity(vllm_config, kv_cache_config)
    _logger().info("kvmem: %s: KV budget %d bytes, %d blocks, %d tokens", rank_label(rank, tp),
                   kv_bytes, kv_cache_config.num_blocks, tokens)


def _logger() -> logging.Logger:
    # A child of vLLM's logger, so that the line is formatted and shown as vLLM's own.
    from vllm.logger import init_logger

    return init_logger("vllm.kvmem")
