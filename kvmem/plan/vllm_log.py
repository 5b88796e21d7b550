"""Read a vLLM start-up log (vLLM 0.9 to 0.33, GPU or CPU) into what decides its KV cache.

``parse_vllm_engines(text)`` splits the text at each engine start (two runs' logs one after
the other are two engines) and reads each; ``parse_vllm_log(text)`` reads all of it as one.
Wherever vLLM or a wrapper put its prefixes, it finds:

- the engine config line ``Initializing a V1 LLM engine (vX) with config: model=...,
  speculative_config=SpeculativeConfig(method=..., num_spec_tokens=N), max_seq_len=...,
  tensor_parallel_size=..., kv_cache_dtype=..., device_config=...``, and ``vLLM API
  server version X``;
- ``non-default args: {...}`` (the flags the user gave, a nested dict such as
  ``speculative_config`` as a dict of its plain values) and ``Chunked prefill is enabled
  with max_num_batched_tokens=N``;
- each worker's KV memory: ``Available KV cache memory: X GiB`` (from 0.9.1), vLLM-CPU's
  ``Explicitly set (X/Y) GiB for KV cache`` / ``Auto set (X/Y) GiB``; the worker's rank
  from its prefix (``Worker_PP1_TP0``, ``VllmWorker rank=3``, ``TP1``), else the order;
- ``GPU KV cache size: N tokens`` (or ``CPU``, ``GPU + host``...) and ``Maximum
  concurrency for L tokens per request: Cx``, on one line or two, once or once per worker;
- the start-up check's error ``(X GiB KV cache is needed, which is larger than the
  available KV cache memory (Y GiB)`` and its estimated maximum model length;
- for hybrid models with Mamba or linear-attention state: ``Setting attention block size
  to N tokens to ensure that attention page size is >= mamba page size.`` (or raised for a
  quantized KV page, or on XPU to a kernel multiple) and ``Padding mamba page size by P%
  to ensure that mamba page size and attention page size are exactly equal.``;
- ``Hybrid KV cache manager is disabled`` (sliding layers charged as full attention);
- vLLM-CPU's ``Reset SSM cache type to float32`` (its host has AVX512-BF16: the states of
  linear-attention layers in float32; without the line, as the model family sets them).

Every reader finds a fixed marker with ``str.find`` and matches its pattern only in a
bounded window at that marker (the engine config and args lines: once, from the marker to
the end), so a line of any length is read in time linear in its length. A line that
carries a marker but does not read as its pattern is kept in ``unreadable`` with its
number. Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmem.errors import ConfigError
from kvmem.units import GiB

# Numbers of bounded length, never a prefix of a longer one (a figure of 5,000 digits is
# a line kvmem cannot read, not a number Python refuses to convert).
_INT = r"(\d{1,12})(?!\d|[.,]\d)"
_GROUPED = r"(\d{1,3}(?:,\d{3}){1,4}|\d{1,15})(?!\d|[.,]\d)"  # 1,460,255 or 1460255
_FLOAT = r"(-?\d{1,9}(?:\.\d{1,6})?)(?!\d|[.,]\d)"
_WINDOW = 400  # characters after a marker a windowed pattern may reach


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
    ssm_float32: bool = False  # vLLM-CPU moved SSM states to float32 (an AVX512-BF16 host)
    cpu_mla: str | None = None  # vLLM-CPU's MLA kernel: "CPU_MLA" (reference) or "AMX_MLA"
    # (line, tokens, "FLASHMLA"): the block size vLLM set for its attention backends
    backend_block_size: tuple[int, int, str] | None = None
    attention_block_size: tuple[int, int, str] | None = None  # (line, tokens, why) raised to
    mamba_padding: tuple[int, str] | None = None  # (line, "0.13"): percent it padded by
    speculative: dict[str, object] = field(default_factory=dict)  # method, num_spec_tokens...
    unreadable: list[tuple[int, str, str]] = field(default_factory=list)  # (line, what, text)
    lines: tuple[int, int] = (1, 0)  # the first and last line of this engine's log
    starts: set[str] = field(default_factory=set)  # the engine-start lines seen
    engine_line: str | None = None  # the engine config line as logged (past its prefix)

    @property
    def model(self) -> str | None:
        """The served model: the engine config's, else the one the args name."""
        named = self.args.get("model")
        return self.config.get("model") or (named if isinstance(named, str) else None)

    @property
    def is_engine(self) -> bool:
        """Whether it logged a version or any KV figure (else it is no engine's log)."""
        return self.version is not None or bool(self.workers or self.sizes or self.needed)

    @property
    def has_figures(self) -> bool:
        return bool(self.workers or self.sizes or self.concurrency or self.needed)

    def int_config(self, key: str) -> int | None:
        value = self.config.get(key)
        return int(value) if value is not None and value.isdigit() else None


# ---------------------------------------------------------------------- the lines read
def _config_fields(text: str) -> dict[str, str]:
    """``key=value`` pairs of the engine config line (values quoted or up to the comma)."""
    fields: dict[str, str] = {}
    # \b: a key is tried only where a word starts (not at each letter of a long word)
    for m in re.finditer(r"\b(\w+)=('[^']*'|[^,{(\[]*)", text):
        fields.setdefault(m[1], m[2].strip().strip("'"))
    return fields


# A quoted key (the next value follows), a quoted string, a bracket; quotes do not nest
# and have no escapes, so an unclosed one is scanned to the end of the text at most once.
_ARG_TOKEN = re.compile(r"'(\w+)': |'[^']*'|\"[^\"]*\"|[{}\[\]()]")
_ARG_VALUE = re.compile(r"'([^']*)'|(-?\d{1,18}(?:\.\d{1,18})?(?:e[+-]?\d{1,3})?)\b|"
                        r"(True|False|None)\b")
_OPEN, _CLOSE = "{[(", "}])"


def _value(m: re.Match) -> object:
    if m[1] is not None:
        return m[1]
    if m[3] is not None:
        return {"True": True, "False": False, "None": None}[m[3]]
    number = float(m[2])
    return int(m[2]) if re.fullmatch(r"-?\d+", m[2]) else number


def _args(text: str) -> dict[str, object]:
    """The ``non-default args`` dict: its plain values, and each nested dict as the dict
    of its own plain values (deeper ones are skipped)."""
    out: dict[str, object] = {}
    depth, parent = 0, None
    for token in _ARG_TOKEN.finditer(text):
        t = token[0]
        if t in _OPEN:
            depth += 1
        elif t in _CLOSE:
            depth -= 1
            parent = None if depth <= 1 else parent
        elif token[1] is not None and depth in (1, 2):
            key = token[1]
            if depth == 1 and text.startswith("{", token.end()):
                parent = key
                out.setdefault(key, {})
            elif (m := _ARG_VALUE.match(text, token.end())) is not None:
                target = out if depth == 1 else out.get(parent) if parent else None
                if isinstance(target, dict):
                    target.setdefault(key, _value(m))
    return out


def _speculative(text: str) -> dict[str, object]:
    """``SpeculativeConfig(method='mtp', model='...', num_spec_tokens=3)``'s fields (vLLM
    writes ``model=None`` for methods without a draft model, such as ngram)."""
    fields: dict[str, object] = {key: None if value == "None" else value
                                 for key, value in _config_fields(text).items()}
    tokens = fields.get("num_spec_tokens")
    if isinstance(tokens, str) and tokens.isdigit() and len(tokens) <= 6:
        fields["num_spec_tokens"] = int(tokens)
    return fields


_PREFIX = re.compile(r"\W{0,8}\(([^)]{0,120})\)")


def _worker(number: int, line: str, gib: float) -> WorkerKV:
    """A worker's KV memory line, with the ranks its prefix names."""
    prefix = _PREFIX.match(line, 0, 140)
    text = prefix[1] if prefix else ""

    def find(pattern: str) -> int | None:
        m = re.search(pattern, text)
        return int(m[1]) if m else None

    return WorkerKV(number, gib, find(r"PP(\d{1,6})"), find(r"TP(\d{1,6})"),
                    find(r"rank=(\d{1,6})"))


_SPEC_MARK = "speculative_config=SpeculativeConfig("


def _engine(log: VllmLog, n: int, m: re.Match) -> None:
    config = m[3]
    log.engine, log.version, log.config = m[1], m[2], _config_fields(config)
    at = config.find(_SPEC_MARK)
    end = config.find(")", at) if at >= 0 else -1
    if end >= 0:
        log.speculative = _speculative(config[at + len(_SPEC_MARK):end])


_ESTIMATE_MARK = "estimated maximum model length is "
_ESTIMATE = re.compile(_INT)


def _needed(log: VllmLog, n: int, m: re.Match) -> None:
    line = m.string
    at = line.find(_ESTIMATE_MARK, m.end())
    estimate = _ESTIMATE.match(line, at + len(_ESTIMATE_MARK)) if at >= 0 else None
    log.needed = (n, int(m[1]), float(m[2]), float(m[3]),
                  int(estimate[1]) if estimate else None)


# What vLLM says it raised the attention block size for -> why, as kvmem says it
BLOCK_RAISES = {
    "attention page size is >= mamba page size": "so an attention page holds a Mamba state "
                                                 "page",
    "quantized primary KV page": "so the quantized KV page covers the higher-precision "
                                 "padded page",
    "to ensure multiple of": "to a multiple of the attention kernel's block",
}


def _why_raised(line: str) -> str:
    return next((why for text, why in BLOCK_RAISES.items() if text in line), "")


def _add_worker(log: VllmLog, n: int, m: re.Match) -> None:
    log.workers.append(_worker(n, m.string, float(m[1])))


@dataclass(frozen=True)
class _Reader:
    """A marker a line must contain, the pattern read at it and what it sets."""

    marker: str
    pattern: re.Pattern
    read: Callable[[VllmLog, int, re.Match], None]
    what: str | None = None  # named when a marked line does not read (None: not named)
    reach: int = 0  # how far before the marker the pattern may start
    to_end: bool = False  # the pattern reads the rest of the line from the marker


def _set(name: str, convert: Callable[[int, re.Match], object]):
    return lambda log, n, m: setattr(log, name, convert(n, m))


_READERS = (
    _Reader("Initializing a ", re.compile(
        r"Initializing a (V\d) LLM engine \(v?([^)\s]{1,64})\) with config: (.*)"),
        _engine, "engine config", to_end=True),
    _Reader("vLLM API server version ", re.compile(r"vLLM API server version v?(\d[^\s,]{0,63})"),
            lambda log, n, m: setattr(log, "version", log.version or m[1])),
    _Reader("non-default args: ", re.compile(r"non-default args: (\{.*\})"),
            _set("args", lambda n, m: _args(m[1])), "non-default args", to_end=True),
    _Reader("Chunked prefill is enabled with ", re.compile(
        r"Chunked prefill is enabled with max_num_batched_tokens=" + _INT),
        _set("max_num_batched_tokens", lambda n, m: int(m[1])), "max_num_batched_tokens"),
    _Reader("Using max model len ", re.compile(r"Using max model len " + _INT),
            _set("max_model_len", lambda n, m: int(m[1]))),
    _Reader("Auto-fit max_model_len: ", re.compile(
        r"Auto-fit max_model_len: reduced from \d{1,12} to " + _INT),
        _set("max_model_len", lambda n, m: int(m[1]))),
    _Reader("Available KV cache memory: ", re.compile(
        r"Available KV cache memory: " + _FLOAT + r" ?GiB"), _add_worker, "KV cache memory"),
    _Reader(" GiB for KV cache", re.compile(
        r"(?:Explicitly|Auto) set \(" + _FLOAT + r"/\d{1,9}(?:\.\d{1,6})?\) GiB for KV cache"),
        _add_worker, "CPU KV cache memory", reach=48),
    _Reader(" KV cache size: ", re.compile(
        r"(\w{1,16}(?: \+ \w{1,16})?) KV cache size: " + _GROUPED + " tokens"),
        lambda log, n, m: log.sizes.append((n, m[1], int(m[2].replace(",", "")))),
        "KV cache size", reach=36),  # "GPU + host KV cache size: "
    _Reader("Maximum concurrency for ", re.compile(
        r"Maximum concurrency for " + _GROUPED + r" tokens per request: (\d{1,9}\.\d{1,6})x"),
        lambda log, n, m: log.concurrency.append((n, int(m[1].replace(",", "")), m[2])),
        "maximum concurrency"),
    _Reader("GiB KV cache is needed", re.compile(
        r"max seq len \(" + _INT + r"\), \(" + _FLOAT + r" GiB KV cache is needed, which is "
        r"larger than the available KV cache memory \(" + _FLOAT + r" GiB\)"),
        _needed, "fit check", reach=48),
    _Reader("Setting attention block size to ", re.compile(
        r"Setting attention block size to " + _INT + " tokens"),
        _set("attention_block_size", lambda n, m: (n, int(m[1]), _why_raised(m.string))),
        "attention block size"),
    _Reader("Setting kv cache block size to ", re.compile(
        r"Setting kv cache block size to " + _INT + r" for ([A-Z0-9_]{1,40}(?:/[A-Z0-9_]{1,40})"
        r"{0,3}) backend"),
        _set("backend_block_size", lambda n, m: (n, int(m[1]), m[2])),
        "block size for the attention backends"),
    _Reader("Padding mamba page size by ", re.compile(
        r"Padding mamba page size by (\d{1,9}(?:\.\d{1,6})?)%"),
        _set("mamba_padding", lambda n, m: (n, m[1])), "mamba page padding"),
    _Reader("Hybrid KV cache manager is disabled", re.compile("Hybrid KV cache manager"),
            _set("hybrid_disabled", lambda n, m: True)),
    _Reader("Reset SSM cache type to float32", re.compile("Reset SSM cache type"),
            _set("ssm_float32", lambda n, m: True)),
    _Reader("_MLA backend.", re.compile(r"Using (CPU_MLA|AMX_MLA) backend\."),
            _set("cpu_mla", lambda n, m: m[1])),
)


# What starts an engine's log: a line of one of these kinds when its log already has one,
# or after its KV figures, is the next engine's.
_STARTS = {"server": "vLLM API server version ", "args": "non-default args: ",
           "engine": "LLM engine (v"}


def _read_line(log: VllmLog, number: int, line: str) -> None:
    for reader in _READERS:
        at = line.find(reader.marker)
        if at < 0:
            continue
        start = max(0, at - reader.reach)
        if reader.to_end:
            m = reader.pattern.match(line, start)
        else:
            m = reader.pattern.search(line, start, at + len(reader.marker) + _WINDOW)
        if m is not None:
            reader.read(log, number, m)
        elif reader.what is not None:
            log.unreadable.append((number, reader.what, line.strip()[:200]))


def _starts_another(log: VllmLog, line: str) -> bool:
    """Whether ``line`` starts the next engine's log rather than continuing ``log``'s."""
    kinds = {kind for kind, marker in _STARTS.items() if marker in line}
    if not kinds:
        return False
    if "engine" in kinds and log.engine_line is not None:
        # data-parallel engine cores log the same config: one engine
        at = line.find(_STARTS["engine"])
        if line[at:] == log.engine_line and kinds == {"engine"} and not log.has_figures:
            return False
    return log.has_figures or bool(kinds & log.starts)


def _read(lines: list[str], first: int, log: VllmLog) -> None:
    for number, line in enumerate(lines, first):
        _read_line(log, number, line)
        for kind, marker in _STARTS.items():
            if (at := line.find(marker)) >= 0:
                log.starts.add(kind)
                if kind == "engine":
                    log.engine_line = line[at:]


def _checked(logs: list[VllmLog], source: str) -> list[VllmLog]:
    engines = [log for log in logs if log.is_engine]
    if not engines:
        raise ConfigError(f"{source} is not a vLLM start-up log: it has none of vLLM's engine "
                          "config, KV cache memory, KV cache size or fit check lines")
    for log in engines:
        if log.engine is not None and log.engine != "V1":
            raise ConfigError(f"{source} is a log of vLLM's {log.engine} engine; kvmem follows "
                              "the KV cache rules of its V1 engine (vLLM 0.9 and later)")
    return engines


def parse_vllm_engines(text: str, source: str = "log") -> list[VllmLog]:
    """Each engine's log in ``text`` (split at each engine start), read; ConfigError when
    none is a vLLM start-up log."""
    logs = [VllmLog()]
    for number, line in enumerate(text.splitlines(), 1):
        if _starts_another(logs[-1], line):
            logs[-1].lines = (logs[-1].lines[0], number - 1)
            logs.append(VllmLog(lines=(number, number)))
        _read([line], number, logs[-1])
        logs[-1].lines = (logs[-1].lines[0], number)
    return _checked(logs, source)


def parse_vllm_log(text: str, source: str = "log") -> VllmLog:
    """All of ``text`` read as one engine's log; ConfigError when it is no vLLM start-up
    log at all."""
    log = VllmLog()
    lines = text.splitlines()
    _read(lines, 1, log)
    log.lines = (1, len(lines))
    return _checked([log], source)[0]
