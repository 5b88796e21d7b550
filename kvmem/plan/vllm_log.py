"""Read a vLLM start-up log (vLLM 0.9 to 0.33, GPU or CPU) into what decides its KV cache.

``parse_vllm_log(text)`` finds, wherever vLLM or a wrapper put its prefixes:

- the engine config line ``Initializing a V1 LLM engine (vX) with config: model=...,
  max_seq_len=..., tensor_parallel_size=..., pipeline_parallel_size=..., kv_cache_dtype=...,
  device_config=...``, and ``vLLM API server version X``;
- ``non-default args: {...}`` (the flags the user gave) and ``Chunked prefill is enabled
  with max_num_batched_tokens=N``;
- each worker's KV memory: ``Available KV cache memory: X GiB`` (from 0.9.1), vLLM-CPU's
  ``Explicitly set (X/Y) GiB for KV cache`` / ``Auto set (X/Y) GiB``; the worker's rank
  from its prefix
  (``Worker_PP1_TP0``, ``VllmWorker rank=3``, ``TP1``), else the order of the lines;
- ``GPU KV cache size: N tokens`` (or ``CPU``...) and ``Maximum concurrency for L tokens
  per request: Cx``, on one line or two;
- the start-up check's error ``(X GiB KV cache is needed, which is larger than the
  available KV cache memory (Y GiB)`` and its estimated maximum model length;
- ``Hybrid KV cache manager is disabled`` (sliding layers charged as full attention).

A line that carries one of these markers but does not read as its pattern is kept in
``unreadable`` with its number. Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvmem.errors import ConfigError
from kvmem.units import GiB

_ENGINE = re.compile(r"Initializing a (V\d) LLM engine \(v?([^)\s]+)\) with config: (.*)")
_SERVER = re.compile(r"vLLM API server version v?(\d[^\s,]*)")
_ARGS = re.compile(r"non-default args: (\{.*\})")
_BATCHED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_MAX_LEN = re.compile(r"Using max model len (\d+)")
_AUTO_FIT = re.compile(r"Auto-fit max_model_len: reduced from (\d+) to (\d+)")
_AVAILABLE = re.compile(r"Available KV cache memory: (-?[\d.]+) ?GiB")
_CPU_SET = re.compile(r"(?:Explicitly|Auto) set \((-?[\d.]+)/[\d.]+\) GiB for KV cache")
_SIZE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_NEEDED = re.compile(r"max seq len \((\d+)\), \((-?[\d.]+) GiB KV cache is needed, which is "
                     r"larger than the available KV cache memory \((-?[\d.]+) GiB\)")
_ESTIMATE = re.compile(r"estimated maximum model length is (\d+)")
_HYBRID_OFF = re.compile("Hybrid KV cache manager is disabled")
_PREFIX = re.compile(r"^\W*\(([^)]*)\)")

# What a line must contain to be one of the lines above (else it is not looked at).
_MARKERS = {
    "engine config": "LLM engine (v", "KV cache memory": "Available KV cache memory",
    "CPU KV cache memory": "GiB for KV cache",
    "KV cache size": "KV cache size:", "maximum concurrency": "Maximum concurrency for",
    "fit check": "KV cache is needed", "non-default args": "non-default args:",
    "max_num_batched_tokens": "Chunked prefill is enabled with",
}


@dataclass(frozen=True)
class WorkerKV:
    """One worker's KV memory as logged (GiB rounded to two decimals)."""

    line: int
    gib: float
    pp_rank: int | None
    tp_rank: int | None
    rank: int | None  # the global rank, when the prefix names it

    @property
    def bytes_range(self) -> tuple[int, int]:
        """The bytes a figure rounded to 0.01 GiB stands for (inclusive)."""
        return max(0, round((self.gib - 0.005) * GiB)), round((self.gib + 0.005) * GiB) - 1


@dataclass
class VllmLog:
    engine: str | None = None  # "V1"
    version: str | None = None
    config: dict[str, str] = field(default_factory=dict)  # from the engine config line
    args: dict[str, object] = field(default_factory=dict)  # non-default args read
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    workers: list[WorkerKV] = field(default_factory=list)
    sizes: list[tuple[int, str, int]] = field(default_factory=list)  # (line, device, tokens)
    concurrency: list[tuple[int, int, str]] = field(default_factory=list)  # (line, len, "1.33")
    needed: tuple[int, int, float, float, int | None] | None = None  # line, len, X, Y, est.
    hybrid_disabled: bool = False
    unreadable: list[tuple[int, str, str]] = field(default_factory=list)  # (line, what, text)

    @property
    def model(self) -> str | None:
        return self.config.get("model")

    def int_config(self, key: str) -> int | None:
        value = self.config.get(key)
        return int(value) if value is not None and value.isdigit() else None


def parse_vllm_log(text: str, source: str = "log") -> VllmLog:
    """Read ``text``; ConfigError when it is no vLLM start-up log at all."""
    log = VllmLog()
    for number, line in enumerate(text.splitlines(), 1):
        _read_line(log, number, line)
    if log.version is None and not (log.workers or log.sizes or log.needed):
        raise ConfigError(f"{source} is not a vLLM start-up log: it has none of vLLM's engine "
                          "config, KV cache memory, KV cache size or fit check lines")
    if log.engine is not None and log.engine != "V1":
        raise ConfigError(f"{source} is a log of vLLM's {log.engine} engine; kvmem follows the "
                          "KV cache rules of its V1 engine (vLLM 0.9 and later)")
    return log


def _engine(log: VllmLog, number: int, m: re.Match) -> None:
    log.engine, log.version, log.config = m[1], m[2], _config_fields(m[3])


def _server(log: VllmLog, number: int, m: re.Match) -> None:
    log.version = log.version or m[1]


def _batched(log: VllmLog, number: int, m: re.Match) -> None:
    log.max_num_batched_tokens = int(m[1])


def _needed(log: VllmLog, number: int, m: re.Match) -> None:
    estimate = _ESTIMATE.search(m.string)
    log.needed = (number, int(m[1]), float(m[2]), float(m[3]),
                  int(estimate[1]) if estimate else None)


# Each pattern and what it reads; a line may carry several.
_READERS = (
    (_ENGINE, _engine),
    (_SERVER, _server),
    (_ARGS, lambda log, n, m: setattr(log, "args", _args(m[1]))),
    (_BATCHED, _batched),
    (_MAX_LEN, lambda log, n, m: setattr(log, "max_model_len", int(m[1]))),
    (_AUTO_FIT, lambda log, n, m: setattr(log, "max_model_len", int(m[2]))),
    (_AVAILABLE, lambda log, n, m: log.workers.append(_worker(n, m.string, float(m[1])))),
    (_CPU_SET, lambda log, n, m: log.workers.append(_worker(n, m.string, float(m[1])))),
    (_SIZE, lambda log, n, m: log.sizes.append((n, m[1], int(m[2].replace(",", ""))))),
    (_CONCURRENCY, lambda log, n, m: log.concurrency.append(
        (n, int(m[1].replace(",", "")), m[2]))),
    (_NEEDED, _needed),
    (_HYBRID_OFF, lambda log, n, m: setattr(log, "hybrid_disabled", True)),
)


def _read_line(log: VllmLog, number: int, line: str) -> None:
    read = False
    for pattern, reader in _READERS:
        if m := pattern.search(line):
            reader(log, number, m)
            read = True
    marked = [what for what, marker in _MARKERS.items() if marker in line]
    if marked and not read:
        log.unreadable.append((number, marked[0], line.strip()[:200]))


def _config_fields(text: str) -> dict[str, str]:
    """``key=value`` pairs of the engine config line (values quoted or up to the comma)."""
    fields: dict[str, str] = {}
    for m in re.finditer(r"(\w+)=('(?:[^'\\]|\\.)*'|[^,{(\[]*)", text):
        fields.setdefault(m[1], m[2].strip().strip("'"))
    return fields


_ARG_VALUE = re.compile(r"'(\w+)': ('[^']*'|-?[\d.e+]+|True|False|None)")


def _args(text: str) -> dict[str, object]:
    """The plain values of the ``non-default args`` dict (nested values are skipped)."""
    out: dict[str, object] = {}
    for m in _ARG_VALUE.finditer(text):
        raw = m[2]
        if raw.startswith("'"):
            value: object = raw.strip("'")
        elif raw in ("True", "False", "None"):
            value = {"True": True, "False": False, "None": None}[raw]
        else:
            try:
                value = int(raw)
            except ValueError:
                value = float(raw)
        out.setdefault(m[1], value)
    return out


def _worker(number: int, line: str, gib: float) -> WorkerKV:
    """A worker's KV memory line, with the ranks its prefix names."""
    prefix = _PREFIX.search(line)
    text = prefix[1] if prefix else ""

    def find(pattern: str) -> int | None:
        m = re.search(pattern, text)
        return int(m[1]) if m else None

    return WorkerKV(number, gib, find(r"PP(\d+)"), find(r"TP(\d+)"), find(r"rank=(\d+)"))
