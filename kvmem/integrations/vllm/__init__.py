"""kvmem inside an unmodified vLLM, through vLLM's own extension points.

One module or subpackage per role:

- ``entry_point``: the ``vllm.general_plugins`` entry point (``entry_point:register``),
  which installs the parts of ``plugin``: it sizes every rank's KV cache with
  :func:`kvmem.plan.plan` when ``KVMEM_VLLM_KV_BUDGET`` is set (``plugin.budget``) and
  checks ``KvmemConnector``'s settings before an engine starts (``plugin.config_check``);
- ``deployment``: ``deployment_plan``, kvmem's plan of the deployment a vLLM
  configuration describes (the budget and elastic KV memory plan with it);
- ``connector``: ``KvmemConnector``, kvmem's CPU and disk tiers as a vLLM KV connector
  (``kv_connector_module_path`` ``"kvmem.integrations.vllm"``;
  ``kv_transfer_config(cpu_offload_gib=...)`` builds vLLM's setting for it);
- ``elastic``: elastic KV memory (``KVMEM_VLLM_KV_MEMORY=elastic``; the plugin adds
  ``KvmemElasticConnector``): each worker's KV cache over a reservation, pages mapped as
  vLLM's block pool hands out blocks, under a limit shared through kvmem's ledger;
- ``kvcache_http``: ``KVCacheRoutes``, ``/kvcache/*`` on vLLM's own port for elastic KV
  memory (``--middleware kvmem.integrations.vllm.KVCacheRoutes``), kvcached's routes;
- ``compat``: what each part needs from vLLM, checked before it loads.

Importing this package imports neither vLLM nor torch; names are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "register": "kvmem.integrations.vllm.entry_point",
    "deployment_plan": "kvmem.integrations.vllm.deployment",
    "KvmemConnector": "kvmem.integrations.vllm.connector",
    "kv_transfer_config": "kvmem.integrations.vllm.connector.config",
    "KVCacheRoutes": "kvmem.integrations.vllm.kvcache_http",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
