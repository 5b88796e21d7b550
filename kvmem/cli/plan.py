"""``kvmem plan MODEL``: what a deployment's KV cache holds, per rank and for the engine.

The flags and the plan they describe are ``kvmem.plan.invocation``'s (shared with the
``kvmem ui`` page); this prints it as a table, JSON, the flags for an engine, or a
stacked-bar plot, and reads a vLLM log with ``--from-vllm-log``. Imports no torch.
"""

from __future__ import annotations

import argparse
import json

from kvmem.plan.invocation import add_arguments, build, elastic_lines
from kvmem.plan.types import FitError

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    if args.from_vllm_log is not None:
        from kvmem.cli.plan_log import run_from_log

        return run_from_log(args)
    result = build(args)
    if args.plot:
        from kvmem.plan.plot import save_plot

        save_plot(result.plan, args.plot)
    if args.json:
        print(json.dumps(result.document(), indent=1))
    else:
        from kvmem.plan.report import print_plan

        result.plan.notes.extend(result.offload_notes())
        print_plan(result.plan, result.command, plot=args.plot)
        if result.elastic is not None:
            print("\n".join(elastic_lines(result.elastic, on_cpu=args.device == "cpu",
                                            huge_pages=result.huge_pages)))
    if args.check or result.plan.engine.num_blocks == 0:  # not one block: no engine starts
        result.plan.check_fit()
    if args.check and result.elastic_error is not None:
        raise FitError(result.elastic_error)
    return 0
