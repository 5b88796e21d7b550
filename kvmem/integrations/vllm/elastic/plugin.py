"""The plugin's part for elastic KV memory: ``KVMEM_VLLM_KV_MEMORY=elastic`` alone turns it on.

vLLM calls the plugin (``entry_point.register``) in every process it starts; this part wraps
``EngineArgs.create_engine_config``, where vLLM turns its arguments into its
configuration: with elastic KV memory on, the KV transfer config it reads gets
``KvmemElasticConnector`` (``config.with_elastic``), and vLLM then starts the
connector in the engine core and in every worker as it would any connector; the
deployment is checked against the settings there (``config.check_deployment``). The
arguments themselves are left as they were. In the engine core process it also wraps
``EngineCoreProc.run_busy_loop``, to wake an idle engine that is asked to give memory
back (``watch``). Before wrapping, ``compat.require("elastic")``
checks everything elastic KV memory uses in vLLM (one line naming what is missing).
Nothing happens when the variable is unset.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from functools import wraps
from typing import Any

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.elastic.config import (
    check_deployment,
    elastic_from_env,
    with_elastic,
)

_MARK = "_kvmem_elastic"


def register_elastic() -> None:
    """Safe to call any number of times in any vLLM process; returns before importing
    vLLM when elastic KV memory is off. A bad setting is one ConfigError line."""
    if elastic_from_env("vllm") is None:
        return
    from kvmem.integrations.vllm import compat

    version = compat.require("elastic")
    from vllm.engine.arg_utils import EngineArgs

    if not getattr(EngineArgs.create_engine_config, _MARK, False):
        if warning := compat.untested_warning(version):
            from vllm.logger import init_logger

            init_logger("vllm.kvmem.elastic").warning("kvmem: %s", warning)
        EngineArgs.create_engine_config = with_elastic_connector(EngineArgs.create_engine_config)
    core = sys.modules.get("vllm.v1.engine.core")  # imported: this is an engine core process
    if core is not None:
        from kvmem.integrations.vllm.elastic.watch import install_core_wakeup

        install_core_wakeup(core)


def with_elastic_connector(create_engine_config: Any) -> Any:
    @wraps(create_engine_config)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        settings = elastic_from_env(str(self.model))
        if settings is None:
            return create_engine_config(self, *args, **kwargs)
        from vllm.config import KVTransferConfig

        given = self.kv_transfer_config
        self.kv_transfer_config = KVTransferConfig(**with_elastic(_as_dict(given), settings))
        try:
            config = create_engine_config(self, *args, **kwargs)
        finally:
            self.kv_transfer_config = given
        try:
            check_deployment(config, settings)
        except ConfigError as exc:  # one line, before any engine process starts
            raise SystemExit(str(exc)) from None
        return config

    setattr(wrapper, _MARK, True)
    return wrapper


def _as_dict(config: Any) -> dict[str, Any] | None:
    """A KV transfer config as vLLM accepts it (object, dict or JSON text) as a dict of the
    fields that were set."""
    if config is None:
        return None
    if isinstance(config, str):
        return json.loads(config)
    if isinstance(config, dict):
        return dict(config)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: v for k, v in fields.items() if k != "engine_id"}
