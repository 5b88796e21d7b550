"""``KvmemConnector``'s tier figures in vLLM's own connector-stats path.

Each worker reports, with every step's output, what its tiers did since its last report
(``RankStatsDelta``): per tier, the counters of ``kvmem.tiers.stats`` as increments and its
gauges as they are, and the rank's measured prefill rate. vLLM joins the workers' reports
with ``KvmemConnectorStats.aggregate`` (``KVOutputAggregator``), hands the result to its
stat loggers as a plain dict, which build it back (``build_kv_connector_stats``) and
aggregate it over their interval: the periodic log line ("KV Transfer metrics: ...",
``reduce``: per tier, summed over ranks) and ``/metrics`` (``KvmemPromMetrics``: the names
``kvmem serve`` uses, with vLLM's ``model_name`` and ``engine`` labels and ``tier`` and
``rank``).

The payload (``data``) is ``{rank: {"prefill_rate": tokens/s or None, "tiers": {tier:
{field: value, "failed_load_causes": {cause: n}}}}}``, every key a string, so it survives
vLLM's serialisation between its processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvmem.tiers.stats import (
    CAPACITY,
    COUNTERS,
    FAILED_LOAD_CAUSES,
    GAUGES,
    PREFILL_RATE,
    TierStats,
    capacity_samples,
    metric_name,
)

CAUSES = "failed_load_causes"
# counters sent as increments: every counter but the total of failed loads (its causes go)
INCREMENTS = tuple(f for f in COUNTERS if f != "failed_loads")


@dataclass
class KvmemConnectorStats(KVConnectorStats):
    """Tier figures of one or more ranks over an interval (see the module docstring)."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        """No tier figures (a report of a new prefill rate alone still reaches /metrics;
        vLLM logs no line for it)."""
        return not any(entry["tiers"] for entry in self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KvmemConnectorStats:
        """Add ``other``'s increments to these, rank by rank and tier by tier; its gauges
        (the later ones) replace these."""
        for rank, theirs in other.data.items():
            mine = self.data.setdefault(rank, {"prefill_rate": None, "tiers": {}})
            if theirs.get("prefill_rate") is not None:
                mine["prefill_rate"] = theirs["prefill_rate"]
            for tier, figures in theirs["tiers"].items():
                into = mine["tiers"].setdefault(tier, {})
                for name, value in figures.items():
                    if name == CAUSES:
                        causes = into.setdefault(CAUSES, {})
                        for cause, n in value.items():
                            causes[cause] = causes.get(cause, 0) + n
                    elif name in GAUGES:
                        into[name] = value
                    else:
                        into[name] = into.get(name, 0) + value
        return self

    def tier_totals(self) -> dict[str, dict[str, float]]:
        """Each tier's figures summed over the ranks."""
        totals: dict[str, dict[str, float]] = {}
        for entry in self.data.values():
            for tier, figures in entry["tiers"].items():
                into = totals.setdefault(tier, {})
                for name, value in figures.items():
                    if name == CAUSES:
                        value = sum(value.values())
                        name = "failed_loads"
                    into[name] = into.get(name, 0) + value
        return totals

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures per tier, summed over ranks, for vLLM's log line."""
        out: dict[str, int | float] = {}
        for tier, t in sorted(self.tier_totals().items()):
            lookups = t.get("lookups", 0)
            if lookups:
                out[f"{tier}_hit_rate"] = round(t.get("hits", 0) / lookups, 3)
            out[f"{tier}_hit_tokens"] = round(t.get("hit_tokens", 0))
            out[f"{tier}_prefill_saved_s"] = round(t.get("prefill_saved_seconds", 0), 3)
            out[f"{tier}_stored_blocks"] = int(t.get("stored_blocks", 0))
            out[f"{tier}_loaded_blocks"] = int(t.get("loaded_blocks", 0))
            if t.get("load_seconds"):
                out[f"{tier}_load_GBps"] = round(t["bytes_loaded"] / t["load_seconds"] / 1e9, 3)
            out[f"{tier}_failed_loads"] = int(t.get("failed_loads", 0))
            out[f"{tier}_evictions"] = int(t.get("evictions", 0))
            out[f"{tier}_wasted_blocks"] = int(t.get("wasted_blocks", 0))
        return out


class RankStatsDelta:
    """A worker's reports: what its tiers did since the last one it sent."""

    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self._sent: dict[str, dict[str, Any]] = {}
        self._sent_rate: float | None = None

    def take(self, tiers: dict[str, TierStats],
             prefill_rate: float | None) -> KvmemConnectorStats | None:
        """The changes since the last report; None when nothing changed."""
        changed: dict[str, dict[str, Any]] = {}
        for tier, stats in tiers.items():
            now = stats.as_dict()
            before = self._sent.get(tier, {})
            figures: dict[str, Any] = {}
            for name in INCREMENTS:
                if step := now[name] - before.get(name, 0):
                    figures[name] = step
            causes = {c: n - before.get(CAUSES, {}).get(c, 0)
                      for c, n in now[CAUSES].items()}
            if causes := {c: n for c, n in causes.items() if n}:
                figures[CAUSES] = causes
            if figures or any(now[g] != before.get(g) for g in GAUGES):
                figures.update({g: now[g] for g in GAUGES})
                changed[tier] = figures
            self._sent[tier] = now
        if not changed and prefill_rate == self._sent_rate:
            return None
        self._sent_rate = prefill_rate
        return KvmemConnectorStats(data={self.rank: {"prefill_rate": prefill_rate,
                                                     "tiers": changed}})


# our collectors in vLLM's registry, dropped when vLLM builds its metrics again (vLLM does
# the same for its own "vllm:" names, but only for those)
_registered: list[Any] = []


class KvmemPromMetrics(KVConnectorPromMetrics):
    """The tiers' figures on vLLM's ``/metrics``: ``kvmem_offload_<field>`` per engine,
    tier and rank (failed loads per cause too) and the ranks' prefill rates."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from prometheus_client import REGISTRY

        while _registered:
            REGISTRY.unregister(_registered.pop())
        labels = [*labelnames, "tier", "rank"]
        self._counters = {
            name: self._counter_cls(name=metric_name(name), documentation=doc,
                                    labelnames=labels + (["cause"] if name == "failed_loads"
                                                         else []))
            for name, doc in COUNTERS.items()}
        self._gauges = {
            name: self._gauge_cls(name=metric_name(name), documentation=doc, labelnames=labels,
                                  multiprocess_mode="mostrecent")
            for name, doc in GAUGES.items()}
        self._rate = self._gauge_cls(name=PREFILL_RATE[0], documentation=PREFILL_RATE[1],
                                     labelnames=[*labelnames, "rank"],
                                     multiprocess_mode="mostrecent")
        self._capacity = {
            name: self._gauge_cls(name=name, documentation=doc, labelnames=[*labels, "kind"],
                                  multiprocess_mode="mostrecent")
            for name, (doc, _, _) in CAPACITY.items()}
        _registered.extend([*self._counters.values(), *self._gauges.values(), self._rate,
                            *self._capacity.values()])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for rank, entry in transfer_stats_data.items():
            if entry.get("prefill_rate") is not None:
                self._rate.labels(*engine, rank).set(entry["prefill_rate"])
            for tier, figures in entry["tiers"].items():
                labels = [*engine, tier, rank]
                for name, value in figures.items():
                    if name == CAUSES:
                        for cause, n in value.items():
                            self._counters["failed_loads"].labels(*labels, cause).inc(n)
                    elif name in GAUGES:
                        self._gauges[name].labels(*labels).set(float(value))
                    elif name in self._counters:
                        self._counters[name].labels(*labels).inc(value)
                if any(name in GAUGES for name in figures):  # sent together
                    for name, _, kind, value in capacity_samples(figures):
                        self._capacity[name].labels(*labels, kind).set(value)
                for cause in FAILED_LOAD_CAUSES:  # every cause shown, 0 until it happens
                    self._counters["failed_loads"].labels(*labels, cause)
