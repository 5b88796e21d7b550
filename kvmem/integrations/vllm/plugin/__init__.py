"""kvmem's vLLM plugin: the ``vllm.general_plugins`` entry point, ``register``.

vLLM calls :func:`register` once in every process it starts. It installs each part that
its settings turn on:

- ``config_check``: ``KvmemConnector``'s settings checked where vLLM builds its
  configuration, whatever else is set (nothing for other connectors);
- ``budget``: every rank's KV budget and the fit check from :func:`kvmem.plan.plan`
  (``KVMEM_VLLM_KV_BUDGET``);
- elastic KV memory (``KVMEM_VLLM_KV_MEMORY``; ``kvmem.integrations.vllm.elastic.plugin``).

A bad setting ends vLLM with one line (``SystemExit``, no traceback) before anything
starts.
"""

from __future__ import annotations

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.plugin.budget import (
    ENV,
    plan_deployment,
    policy_from_env,
    with_kvmem_budgets,
)

__all__ = ["ENV", "plan_deployment", "policy_from_env", "register", "with_kvmem_budgets"]


def register() -> None:
    """vLLM's entry point; safe to call any number of times in any vLLM process."""
    from kvmem.integrations.vllm.elastic.plugin import register_elastic
    from kvmem.integrations.vllm.plugin import budget, config_check

    config_check.install()
    try:
        register_elastic()  # KVMEM_VLLM_KV_MEMORY
        budget.install_budgets()  # KVMEM_VLLM_KV_BUDGET
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
