"""kvmem inside an unmodified vLLM, through vLLM's own extension points.

- ``kvmem.integrations.vllm.plugin:register``: the ``vllm.general_plugins`` entry point that
  sizes every rank's KV cache with :func:`kvmem.plan.plan` when ``KVMEM_VLLM_KV_BUDGET`` is
  set (inert otherwise);
- ``KvmemConnector`` (``kvmem.integrations.vllm.connector``): kvmem's CPU and disk tiers
  as a vLLM KV connector (``kv_connector_module_path`` ``"kvmem.integrations.vllm"``;
  ``kv_transfer_config(cpu_offload_gib=...)`` builds vLLM's setting for it);
- elastic KV memory (``KVMEM_VLLM_KV_MEMORY=elastic``; the plugin adds
  ``KvmemElasticConnector`` from ``elastic_connector``): each worker's KV cache over a
  reservation, pages mapped as vLLM's block pool hands out blocks, under a limit shared
  through kvmem's ledger (``elastic_config``, ``elastic_plugin``, ``elastic_pool``,
  ``elastic_worker``, ``elastic_layout``);
- ``kvmem.integrations.vllm.compat``: what each part needs from vLLM, checked before it
  loads (``KvmemConnector`` is checked before its module imports vLLM's connector API).

Importing this package imports neither vLLM nor torch; names are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "register": "kvmem.integrations.vllm.plugin",
    "KvmemConnector": "kvmem.integrations.vllm.connector",
    "kv_transfer_config": "kvmem.integrations.vllm.connector_config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "KvmemConnector":
        from kvmem.integrations.vllm.compat import require

        require("connector")  # one line naming what vLLM lacks, before importing its API
    return getattr(importlib.import_module(module), name)
