"""User-facing errors: one clear line each, turned into exit code 2 by the CLI."""


class KvmemError(Exception):
    """An error caused by the user's input or environment; its message is one line."""


class ConfigError(KvmemError):
    """A model config, layout or engine setting that cannot be used."""


class UnknownModelError(KvmemError):
    """A model name that is neither a path nor in the catalog."""
