"""The vLLM versions kvmem's vLLM integration supports, checked when it loads.

The plugin wraps functions whose signatures and roles are particular to vLLM's V1 engine
at these versions (``get_kv_cache_configs`` in the engine core, the worker's
``initialize_from_config``); on any other version it refuses in one line rather than patch
code it was not written against.
"""

from __future__ import annotations

from kvmem.errors import ConfigError

SUPPORTED_VLLM = ("0.32",)  # major.minor series; any patch release of them


def supported(version: str) -> bool:
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) in SUPPORTED_VLLM


def check_vllm_version(version: str | None = None) -> str:
    """Return vLLM's version, or raise ConfigError (one line) when it is not supported."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not supported(version):
        series = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM)
        raise ConfigError(f"kvmem's vLLM integration supports vLLM {series}, not {version}")
    return version
