"""``KvmemConnector``'s settings checked where vLLM builds its configuration, before it
starts an engine process or loads a weight.

vLLM builds ``KvmemConnector`` only once the model has loaded and the KV cache is sized,
so a bad ``kv_connector_extra_config`` value used to surface minutes into start-up, in
every process at once. kvmem's plugin (``entry_point.register``, which vLLM calls first thing
in the process that parses its arguments) wraps ``EngineArgs.create_engine_config``
there: a configuration naming ``KvmemConnector`` has its extra config checked as soon as
it is built, and a bad value ends vLLM with one line naming the key (``SystemExit``, no
traceback). The connector checks the same values again when it is built, for processes
started without the plugin.

Imports no vLLM: the wrapped function is taken from ``sys.modules``, where vLLM put it.
"""

from __future__ import annotations

import sys
from functools import wraps
from typing import Any

from kvmem.errors import ConfigError

CONNECTOR = "KvmemConnector"
_MARK = "_kvmem_checks_connector"


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config`` in the process that imported it (the one
    parsing vLLM's arguments); elsewhere do nothing. Safe to call more than once."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    engine_args = getattr(arg_utils, "EngineArgs", None)
    create = getattr(engine_args, "create_engine_config", None)
    if create is None or getattr(create, _MARK, False):
        return
    engine_args.create_engine_config = checked(create)


def checked(create_engine_config: Any) -> Any:
    @wraps(create_engine_config)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = create_engine_config(self, *args, **kwargs)
        exit_on_bad_settings(config.kv_transfer_config)
        return config

    setattr(wrapper, _MARK, True)
    return wrapper


def exit_on_bad_settings(kv_transfer_config: Any) -> None:
    """``SystemExit`` with one line naming the key when a ``KvmemConnector`` configuration
    holds a bad value, alone or inside vLLM's ``MultiConnector`` (as elastic KV memory
    runs it); nothing for other connectors."""
    if kv_transfer_config is None:
        return
    from kvmem.integrations.vllm.connector.config import parse_extra_config

    try:
        for extra in _kvmem_extra_configs(kv_transfer_config.kv_connector,
                                          kv_transfer_config.kv_connector_extra_config):
            parse_extra_config(extra)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


def _kvmem_extra_configs(connector: str | None, extra: Any) -> list[Any]:
    """The ``kv_connector_extra_config`` of every ``KvmemConnector`` in a configuration."""
    if connector == CONNECTOR:
        return [extra]
    if connector == "MultiConnector" and isinstance(extra, dict):
        return [child.get("kv_connector_extra_config")
                for child in extra.get("connectors") or ()
                if isinstance(child, dict) and child.get("kv_connector") == CONNECTOR]
    return []
