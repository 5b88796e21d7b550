"""kvmem inside an unmodified vLLM, through vLLM's own extension points.

- ``kvmem.integrations.vllm.plugin:register``: the ``vllm.general_plugins`` entry point that
  sizes every rank's KV cache with :func:`kvmem.plan.plan` when ``KVMEM_VLLM_KV_BUDGET`` is
  set (inert otherwise);
- ``kvmem.integrations.vllm.compat``: the vLLM versions this package supports;
- ``KvmemConnector`` (``kvmem.integrations.vllm.connector``): kvmem's CPU and disk tiers
  as a vLLM KV connector (``kv_connector_module_path`` ``"kvmem.integrations.vllm"``).

Importing this package imports neither vLLM nor torch; names are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "register": "kvmem.integrations.vllm.plugin",
    "SUPPORTED_VLLM": "kvmem.integrations.vllm.compat",
    "check_vllm_version": "kvmem.integrations.vllm.compat",
    "KvmemConnector": "kvmem.integrations.vllm.connector",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
