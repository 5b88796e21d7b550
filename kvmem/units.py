"""Parsing and printing of byte sizes ("5GiB", "512MiB", "1.5e9")."""

from __future__ import annotations

import math
import re

from kvmem.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
MAX_BYTES = 1 << 50  # 1 PiB: far above any device or host memory; larger sizes are typos

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Parse a byte size such as ``5GiB``, ``512MiB``, ``1.5GB`` or ``123456``; must be > 0
    and at most ``MAX_BYTES`` (inf, nan and overflowing figures are errors)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text) if abs(text) <= MAX_BYTES else math.inf  # 10**400: no float
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot read {text!r} as a size "
                              "(examples: 5GiB, 512MiB, 1e9)")
        value = float(match.group(1)) * _UNITS[unit]
    return _checked_bytes(value, text, what)


def gib_bytes(value: float, what: str, allow_zero: bool = False,
              text: str | None = None) -> int:
    """Bytes of ``value`` GiB: positive (or zero when ``allow_zero``), finite, at most
    ``MAX_BYTES``; ``text`` is the value as the user wrote it, for the error."""
    if allow_zero and value == 0:
        return 0
    return _checked_bytes(value * GiB, f"{text or value} GiB", what)


def _checked_bytes(value: float, text: object, what: str) -> int:
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ConfigError(f"{what}: {text!r} is not a usable size (at most 1 PiB)")
    if int(value) <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float, digits: int = 2) -> str:
    """Render bytes in binary units, e.g. ``13.98 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"
