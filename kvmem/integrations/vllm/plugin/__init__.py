"""The parts kvmem's vLLM plugin installs (``kvmem.integrations.vllm.entry_point``,
vLLM's ``vllm.general_plugins`` entry point):

- ``budget``: every rank's KV budget and the fit check from :func:`kvmem.plan.plan`
  (``KVMEM_VLLM_KV_BUDGET``);
- ``config_check``: ``KvmemConnector``'s settings checked where vLLM builds its
  configuration.
"""

from __future__ import annotations

from kvmem.integrations.vllm.plugin.budget import (
    ENV,
    plan_deployment,
    policy_from_env,
    with_kvmem_budgets,
)

__all__ = ["ENV", "plan_deployment", "policy_from_env", "with_kvmem_budgets"]
