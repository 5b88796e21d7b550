"""``kvmem vllm-check``: which parts of kvmem's vLLM integration work with the vLLM
installed here, and why not (``kvmem.integrations.vllm.compat``), and whether kvmem's own
``KVMEM_VLLM_*`` settings in this environment would be accepted (read by the same code
that reads them inside vLLM); with ``--stats URL``, whether each offload tier of a running
server (vLLM with ``KvmemConnector``, or ``kvmem serve``) pays, read from its ``/metrics``
(``kvmem.tiers.verdict``)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

MAX_RATES = 8  # ranks' prefill rates named on the first line
SCRAPE_TIMEOUT_S = 10.0  # the server's whole answer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--stats", metavar="URL", default=None,
                   help="instead: read the offload tiers' figures from a server's /metrics "
                        "(vLLM with KvmemConnector, or kvmem serve) and say per tier "
                        "whether it pays")


def run_stats(url: str, as_json: bool) -> int:
    """The tiers' verdicts from ``url``; exit 2 (one line) when it has no tier figures."""
    from kvmem.errors import KvmemError
    from kvmem.tiers.scrape import metrics_url, scrape, shown
    from kvmem.tiers.verdict import read_figures, verdict_lines

    url = metrics_url(url)
    page = scrape(url, timeout_s=SCRAPE_TIMEOUT_S)
    try:
        figures = read_figures(page)
    except KvmemError as exc:
        raise KvmemError(f"{url}: {exc}") from None
    if not figures.tiers:
        raise KvmemError(f"{url} shows no kvmem_offload_* figures (is KvmemConnector, or an "
                         "offload tier, configured there? vLLM shows them after its first "
                         "steps)")
    if as_json:
        print(json.dumps({"tiers": [t.as_dict() for t in figures.tiers.values()],
                          "prefill_rates": figures.prefill_rates}, indent=1))
        return 0
    rates = [f"{shown(rank, 16)}: {rate:.0f}" for rank, rate in figures.prefill_rates.items()]
    if len(rates) > MAX_RATES:
        rates[MAX_RATES:] = [f"and {len(rates) - MAX_RATES} more ranks"]
    print(f"{url}: measured prefill rate (tokens/s) {', '.join(rates) or 'not yet measured'}")
    for tier in figures.tiers.values():
        print("\n".join(verdict_lines(tier)))
    return 0


def environment_status():
    """kvmem's ``KVMEM_VLLM_*`` variables here, through the parsers the plugin uses in
    vLLM (a bad value stops vLLM's start-up with the same line); and a note for each
    other name with that prefix (a misspelt variable would be ignored)."""
    from kvmem.errors import ConfigError
    from kvmem.integrations.vllm.compat import FeatureStatus
    from kvmem.integrations.vllm.elastic import config as elastic_config
    from kvmem.integrations.vllm.plugin import ENV as BUDGET_ENV
    from kvmem.integrations.vllm.plugin import policy_from_env

    known = {BUDGET_ENV, elastic_config.MODE_ENV, elastic_config.LIMIT_ENV,
             elastic_config.MAX_ENV, elastic_config.MIN_ENV, elastic_config.NAME_ENV,
             elastic_config.FAULTS_ENV}
    given = sorted(k for k in os.environ if k.startswith("KVMEM_VLLM_"))
    notes = [f"{name} is set but is not one of kvmem's settings for vLLM "
             f"({', '.join(sorted(known))})" for name in given if name not in known]
    reasons = []
    for parse in (policy_from_env, lambda: elastic_config.elastic_from_env("vllm")):
        try:
            parse()
        except ConfigError as exc:
            reasons.append(str(exc))
    set_ = ", ".join(f"{k}={os.environ[k]}" for k in given if k in known) or "none set"
    return FeatureStatus("environment", f"kvmem's KVMEM_VLLM_* settings here ({set_})",
                         not reasons, tuple(reasons)), notes


def run(args: argparse.Namespace) -> int:
    """0 when every part works and the settings are accepted, 1 otherwise (vLLM missing
    included)."""
    from kvmem.cli.output import PIPE_CLOSED, guarded_stdout

    with guarded_stdout() as written:
        status = run_stats(args.stats, args.json) if args.stats is not None else \
            run_check(args.json)
    return PIPE_CLOSED if written.closed_early else status


def run_check(as_json: bool) -> int:
    from kvmem.integrations.vllm import compat

    version, statuses = compat.report()
    environment, notes = environment_status()
    statuses.append(environment)
    notes = [*notes, *compat.NOTES]
    if as_json:
        print(json.dumps({"vllm": version, "tested": list(compat.TESTED_VLLM),
                          "features": [asdict(s) for s in statuses],
                          "notes": notes}, indent=1))
        return 0 if all(s.works for s in statuses) else 1
    series = ", ".join(f"{s}.x" for s in compat.TESTED_VLLM)
    if version is None:
        print(f"vLLM: cannot be imported here ({compat.vllm_import_error()}); kvmem's "
              f"integration is tested with {series}")
    else:
        note = "" if compat.tested(version) else " (untested: checked feature by feature)"
        print(f"vLLM {version}{note}; kvmem's integration is tested with {series}")
    for s in statuses:
        print(f"  {'yes' if s.works else 'no ':3}  {s.name:20}  {s.description}")
        for reason in s.reasons:
            print(f"{'':27}{reason}")
    for note in notes:
        print(f"  note: {note}")
    return 0 if all(s.works for s in statuses) else 1
