"""``kvmem plan --from-vllm-log FILE [MODEL]``: a vLLM start-up log beside kvmem's plan.

Reads the log (``-``: standard input), plans the deployment it describes from the model's
config (MODEL, a catalog name or a path; else the model the log names) under the logged
vLLM release's rules, and prints per rank and for the engine what vLLM logged and what
kvmem computes, then what kvmem would do better with the commands to paste
(``kvmem.plan.from_log``). Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmem.errors import ConfigError, KvmemError

LOG_LIMIT = 256 << 20  # far above any start-up log


def _read(path: str) -> str:
    if path == "-":
        data = sys.stdin.buffer.read(LOG_LIMIT + 1)
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
        return load_spec(name), name
    except KvmemError as exc:
        if model is not None:
            raise
        raise ConfigError(f"the log's model {logged!r}: {exc}; give its config.json or model "
                          "directory (kvmem plan --from-vllm-log FILE MODEL)") from None


def run_from_log(args: argparse.Namespace) -> int:
    from kvmem.plan.from_log import compare_log
    from kvmem.plan.vllm_log import parse_vllm_log

    source = "standard input" if args.from_vllm_log == "-" else args.from_vllm_log
    log = parse_vllm_log(_read(args.from_vllm_log), source)
    spec, name = _spec(args.model, log.model)
    # commands name the model as vLLM served it
    result = compare_log(log, spec, log.model or name, args.vllm_version)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        from kvmem.plan.log_report import print_comparison

        print_comparison(result)
    return 0
