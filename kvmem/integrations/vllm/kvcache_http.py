"""``/kvcache/*`` on vLLM's own port: elastic KV memory steered over HTTP inside vLLM.

vLLM's OpenAI server loads ASGI middleware by import path (``--middleware``), which is the
seam used here; no vLLM function is wrapped::

    KVMEM_VLLM_KV_MEMORY=elastic vllm serve MODEL \\
        --middleware kvmem.integrations.vllm.KVCacheRoutes

The routes (``kvmem.memory.http_control``) act on this server's engine: the ledger name
kvmem's vLLM plugin gave it, which it made in this same process when vLLM built its
configuration (``KVMEM_VLLM_ENGINE_NAME``, else ``vllm-<model>-<pid>``). vLLM's own
``--api-key`` guards only ``/v1`` and a few other prefixes; these routes take the same
keys (``--api-key`` or ``VLLM_API_KEY``) themselves.
"""

from __future__ import annotations

import os
from typing import Any

from kvmem.memory.http_control import (
    ControlError,
    KVCacheControl,
    KVCacheControlMiddleware,
    Scope,
)

from .elastic.config import LEDGER_ENV, MODE_ENV, elastic_from_env


def _server_args(scope: Scope) -> Any:
    app = scope.get("app")
    return getattr(getattr(app, "state", None), "args", None)


class KVCacheRoutes(KVCacheControlMiddleware):
    """The middleware vLLM's ``--middleware`` builds with the app alone."""

    def __init__(self, app: Any) -> None:
        self._scope: Scope = {}
        super().__init__(app, KVCacheControl(self._engine_name,
                                             ledger_dir=os.environ.get(LEDGER_ENV) or None),
                         api_keys=self._api_keys)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self._scope:
            self._scope = scope  # the app and its arguments, for the engine's name
        await super().__call__(scope, receive, send)

    def _engine_name(self) -> str:
        args = _server_args(self._scope)
        settings = elastic_from_env(str(getattr(args, "model", None) or "vllm"))
        if settings is None:
            raise ControlError(409, f"this vLLM server's KV memory is not elastic (start it "
                                    f"with {MODE_ENV}=elastic)")
        return settings.engine_name

    @staticmethod
    def _api_keys(scope: Scope) -> list[str]:
        args = _server_args(scope)
        return [k for k in (getattr(args, "api_key", None) or
                            [os.environ.get("VLLM_API_KEY", "")]) if k]
