"""Files a user names (a model's config.json, a memory profile, a ledger), read with a
bound: a path to ``/dev/zero``, a FIFO or a huge file must be a one-line error, never a
read that runs until memory does. Imports no torch."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvmem.errors import ConfigError
from kvmem.units import MiB, format_bytes

# Far above any real one (a config.json is kilobytes, a 405B model's safetensors index
# about 2 MiB, a tokenizer_config.json with a long chat template a few MiB).
JSON_LIMIT = 64 * MiB


def check_regular(path: str | Path, what: str) -> None:
    """ConfigError unless ``path`` is a regular file (a device or FIFO can be read forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what} {path}: not a regular file")


def read_bounded(path: str | Path, what: str, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (else ConfigError,
    naming ``what``)."""
    check_regular(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read ({e.strerror})") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path}: larger than {format_bytes(limit)}; is it the right "
                          "file?")
    return data
