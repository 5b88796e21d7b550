"""Parsing and printing of byte sizes ("5GiB", "512MiB", "1.5e9")."""

from __future__ import annotations

import re

from kvmem.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Parse a byte size such as ``5GiB``, ``512MiB``, ``1.5GB`` or ``123456``; must be > 0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot read {text!r} as a size "
                              "(examples: 5GiB, 512MiB, 1e9)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


def format_bytes(n: float, digits: int = 2) -> str:
    """Render bytes in binary units, e.g. ``13.98 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"
