"""``kvmem plan --from-vllm-log FILE [MODEL]``: a vLLM start-up log beside kvmem's plan.

Reads the log (``-``: standard input), plans the deployment it describes from the model's
config (MODEL, a catalog name or a path; else the model the log names) under the logged
vLLM release's rules, and prints per rank and for the engine what vLLM logged and what
kvmem computes, then what kvmem would do better with the commands to paste
(``kvmem.plan.from_log``). A log of several engine starts is reported engine by engine
(MODEL, when given, for each); one that cannot be compared is named on standard error and
the status is 2. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from kvmem.errors import ConfigError, KvmemError

LOG_LIMIT = 256 << 20  # far above any start-up log
MAX_ENGINES = 64  # each is planned several times over: a log of thousands would take hours


def _read(path: str) -> str:
    if path == "-":
        try:
            data = sys.stdin.buffer.read(LOG_LIMIT + 1)
        except (AttributeError, OSError, ValueError):  # no stdin, or it was closed (<&-)
            raise ConfigError("standard input is closed: give the log's path, or pipe "
                              "the log in") from None
        if len(data) > LOG_LIMIT:
            raise ConfigError("standard input: larger than 256 MiB; is it a vLLM log?")
    else:
        from kvmem.files import read_bounded

        data = read_bounded(path, "--from-vllm-log", LOG_LIMIT)
    return data.decode("utf-8", errors="replace")


def _spec(model: str | None, logged: str | None):
    from kvmem.spec import load_spec

    name = model or logged
    if name is None:
        raise ConfigError("the log names no model: give its config.json or model directory "
                          "(kvmem plan --from-vllm-log FILE MODEL)")
    try:
        try:
            return load_spec(name), name
        except OSError as exc:  # a logged name no file system takes (too long, ...)
            raise ConfigError(f"cannot read it ({exc.strerror})") from None
    except KvmemError as exc:
        if model is not None:
            raise
        shown = logged if len(logged) <= 80 else logged[:77] + "..."
        raise ConfigError(f"the log's model {shown!r}: {exc}; give its config.json or model "
                          "directory (kvmem plan --from-vllm-log FILE MODEL)") from None


def _compare(log, args: argparse.Namespace):
    from kvmem.plan.from_log import compare_log

    spec, name = _spec(args.model, log.model)
    # commands name the model as vLLM served it
    return compare_log(log, spec, log.model or name, args.vllm_version)


@dataclass
class _Failed:
    """An engine of several that kvmem cannot compare, and why."""

    lines: tuple[int, int]
    error: str

    def to_dict(self) -> dict:
        return {"lines": list(self.lines), "error": self.error}


def _print(reports: list, as_json: bool) -> None:
    """Each engine's report: one as it is, several each under the log lines it read."""
    if as_json:
        documents = [r.to_dict() for r in reports]
        print(json.dumps(documents[0] if len(documents) == 1 else {"engines": documents},
                         indent=1))
        return
    from kvmem.plan.log_report import print_comparison

    for i, report in enumerate(reports):
        if len(reports) > 1:
            print(f"{'' if i == 0 else chr(10)}engine {i + 1} of {len(reports)} (log lines "
                  f"{report.lines[0]}-{report.lines[1]}):")
        if isinstance(report, _Failed):
            print(f"kvmem: error: {report.error}")
        else:
            print_comparison(report)


def run_from_log(args: argparse.Namespace) -> int:
    from kvmem.cli.output import PIPE_CLOSED, guarded_stdout
    from kvmem.plan.vllm_log import parse_vllm_engines

    source = "standard input" if args.from_vllm_log == "-" else args.from_vllm_log
    engines = parse_vllm_engines(_read(args.from_vllm_log), source)
    if len(engines) > MAX_ENGINES:
        starts = ", ".join(str(log.lines[0]) for log in engines[:3])
        raise ConfigError(f"{source} holds {len(engines):,} engine starts (at lines {starts}, "
                          f"...); kvmem compares at most {MAX_ENGINES} at once: give it part "
                          "of the log")
    reports: list = []
    errors = []
    for log in engines:
        try:
            reports.append(_compare(log, args))
        except KvmemError as exc:
            if len(engines) == 1:
                raise
            error = f"the engine at log lines {log.lines[0]}-{log.lines[1]}: {exc}"
            reports.append(_Failed(log.lines, error))
            errors.append(error)
    with guarded_stdout() as written:
        _print(reports, args.json)
    if written.closed_early:
        return PIPE_CLOSED
    if errors:
        raise ConfigError("; ".join(errors))
    return 0
