"""``kvmem vllm-check``: which parts of kvmem's vLLM integration work with the vLLM
installed here, and why not (``kvmem.integrations.vllm.compat``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """0 when every part works, 1 otherwise (vLLM missing included)."""
    from kvmem.integrations.vllm import compat

    version, statuses = compat.report()
    if args.json:
        print(json.dumps({"vllm": version, "tested": list(compat.TESTED_VLLM),
                          "features": [asdict(s) for s in statuses],
                          "notes": list(compat.NOTES)}, indent=1))
        return 0 if all(s.works for s in statuses) else 1
    series = ", ".join(f"{s}.x" for s in compat.TESTED_VLLM)
    if version is None:
        print(f"vLLM: cannot be imported here (kvmem's integration is tested with {series})")
    else:
        note = "" if compat.tested(version) else " (untested: checked feature by feature)"
        print(f"vLLM {version}{note}; kvmem's integration is tested with {series}")
    for s in statuses:
        print(f"  {'yes' if s.works else 'no ':3}  {s.name:20}  {s.description}")
        for reason in s.reasons:
            print(f"{'':27}{reason}")
    for note in compat.NOTES:
        print(f"  note: {note}")
    return 0 if all(s.works for s in statuses) else 1
