"""kvmem's vLLM plugin entry point: ``register``, named under ``vllm.general_plugins``.

vLLM calls :func:`register` once in every process it starts. It installs each part that
its settings turn on:

- ``plugin.config_check``: ``KvmemConnector``'s settings checked where vLLM builds its
  configuration, whatever else is set (nothing for other connectors);
- kvmem's connectors named in vLLM's connector factory, where vLLM looks a connector's
  class up by name (``MultiConnector`` rebuilds each child's stats that way: without it,
  ``KvmemConnector``'s figures beside elastic KV memory would end vLLM's output handler);
- ``plugin.budget``: every rank's KV budget and the fit check from :func:`kvmem.plan.plan`
  (``KVMEM_VLLM_KV_BUDGET``);
- elastic KV memory (``KVMEM_VLLM_KV_MEMORY``; ``kvmem.integrations.vllm.elastic.plugin``).

A bad setting ends vLLM with one line (``SystemExit``, no traceback) before anything
starts. Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib

from kvmem.errors import ConfigError

__all__ = ["CONNECTORS", "register"]


def register() -> None:
    """vLLM's entry point; safe to call any number of times in any vLLM process."""
    from kvmem.integrations.vllm.elastic.plugin import register_elastic
    from kvmem.integrations.vllm.plugin import budget, config_check

    config_check.install()
    _name_connectors()
    try:
        register_elastic()  # KVMEM_VLLM_KV_MEMORY
        budget.install_budgets()  # KVMEM_VLLM_KV_BUDGET
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


CONNECTORS = {  # name -> module that has it
    "KvmemConnector": "kvmem.integrations.vllm",
    "KvmemElasticConnector": "kvmem.integrations.vllm.elastic.connector",
}


def _name_connectors() -> None:
    """Register kvmem's connectors with vLLM's factory by name (lazily: nothing imports
    before vLLM asks); a vLLM without the factory's ``register_connector`` is left as it
    is (``compat`` names it when the connector loads)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    register = getattr(KVConnectorFactory, "register_connector", None)
    if register is None:
        return
    for name, module in CONNECTORS.items():
        # vLLM calls the plugin more than once per process: a second naming raises
        with contextlib.suppress(ValueError):
            register(name, module, name)
