"""``KvmemConnector``: kvmem's CPU and disk tiers as a vLLM KV connector.

- ``kvmem_connector``: the connector class vLLM builds once per role (scheduler, worker);
- ``scheduler``: the scheduler side (lookups by kvmem's prefix hashes, each step's loads
  and stores);
- ``worker``: each worker's tiers over its own KV tensors;
- ``layout``: the KV cache groups' rules and vLLM's KV tensors as slot tensors;
- ``meta``: the step's messages, both ways;
- ``config``: ``kv_connector_extra_config``, strictly typed, and ``kv_transfer_config``.

Importing this package imports neither vLLM nor torch; ``KvmemConnector`` is checked
against the installed vLLM (``compat.require("connector")``) before its module imports
vLLM's connector API.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name != "KvmemConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvmem.integrations.vllm.compat import require

    require("connector")  # one line naming what vLLM lacks, before importing its API
    from kvmem.integrations.vllm.connector.kvmem_connector import KvmemConnector

    return KvmemConnector
