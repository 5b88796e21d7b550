"""Does each tier pay? The tiers' figures read from a ``/metrics`` page (vLLM with
``KvmemConnector``, or ``kvmem serve``), summed over ranks and engines, and what they say.

Per tier: the hit rate (blocks found / blocks looked up), the load speed (bytes loaded /
seconds loading), the prefill seconds its loads saved per GiB of its budget, the share of
its stores never loaded, and whether loading paid: the prefill time the loads saved
against the time they took. Every figure is over the server's life so far (one scrape);
``docs/offload.md`` gives the same as PromQL over a window. Pure Python; the page's
``kvmem_`` lines, and only those, are parsed with ``prometheus_client``, so a server's
other series cost nothing and cannot stop the reading. The page itself is read by
``kvmem.tiers.scrape``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvmem.errors import KvmemError
from kvmem.tiers.scrape import shown
from kvmem.tiers.stats import COUNTERS, GAUGES, PREFILL_RATE, metric_name
from kvmem.units import GiB, format_bytes

MAX_LINES = 20_000  # 64 ranks with 4 tiers show some 7,000; parsing 20,000 takes ~1 s
MAX_TIERS = 64
MAX_RANKS = 4096
MAX_CAUSES = 8  # of failed loads, shown
LARGEST = float(1 << 63)  # no count, size or time of a tier comes near
# kvmem's own lines, and nothing else of a page, go to the parser
_OURS = re.compile(r"^(?:# (?:HELP|TYPE) )?kvmem_[^\n]*", re.MULTILINE)


@dataclass
class TierFigures:
    """One tier's figures, summed over every rank and engine on the page."""

    tier: str
    values: dict[str, float] = field(default_factory=dict)  # TierStats field -> sum
    failed_load_causes: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    @property
    def hit_rate(self) -> float | None:
        return self.get("hits") / self.get("lookups") if self.get("lookups") else None

    @property
    def load_gb_per_s(self) -> float | None:
        seconds = self.get("load_seconds")
        return self.get("bytes_loaded") / seconds / 1e9 if seconds else None

    @property
    def saved_s_per_gib(self) -> float | None:
        capacity = self.get("capacity_bytes")
        return self.get("prefill_saved_seconds") / (capacity / GiB) if capacity else None

    @property
    def wasted_share(self) -> float | None:
        """Stores never loaded: those already gone unloaded (and, as an upper bound, with
        those still held and not loaded yet)."""
        stored = self.get("stored_blocks")
        return self.get("wasted_blocks") / stored if stored else None

    @property
    def wasted_share_at_most(self) -> float | None:
        stored = self.get("stored_blocks")
        return (self.get("wasted_blocks") + self.get("unused_blocks")) / stored if stored \
            else None

    @property
    def payback(self) -> float | None:
        """Prefill seconds saved per second spent loading."""
        seconds = self.get("load_seconds")
        return self.get("prefill_saved_seconds") / seconds if seconds else None

    def as_dict(self) -> dict:
        return {"tier": self.tier, **self.values, "failed_load_causes": self.failed_load_causes,
                "hit_rate": self.hit_rate, "load_gb_per_s": self.load_gb_per_s,
                "prefill_saved_s_per_gib": self.saved_s_per_gib,
                "wasted_share": self.wasted_share,
                "wasted_share_at_most": self.wasted_share_at_most,
                "payback": self.payback}


@dataclass
class Figures:
    tiers: dict[str, TierFigures]
    prefill_rates: dict[str, float]  # rank (or "engine") -> measured tokens per second


def _our_lines(text: str) -> str:
    lines = []
    for match in _OURS.finditer(text):
        if len(lines) == MAX_LINES:
            raise KvmemError(f"more than {MAX_LINES} kvmem_ lines: not a page kvmem reads")
        lines.append(match.group())
    return "\n".join([*lines, ""])


def read_figures(text: str) -> Figures:
    """The tiers' figures on a ``/metrics`` page (no tier: empty); a one-line
    ``KvmemError`` for figures no tier could have (not a number from 0 to 2**63) or more
    tiers, ranks or lines than a server has."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise KvmemError("reading /metrics needs prometheus-client (pip install "
                         "'kvmem[serve]')") from None

    wanted = {f"{metric_name(n)}_total": n for n in COUNTERS} | \
             {metric_name(n): n for n in GAUGES}
    tiers: dict[str, TierFigures] = {}
    rates: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(_our_lines(text)))
    except ValueError as exc:
        raise KvmemError(f"not a Prometheus metrics page ({shown(str(exc), 120)})") from None
    for family in families:
        for s in family.samples:
            if s.name == PREFILL_RATE[0]:
                rank = s.labels.get("rank", "engine")
                if rank not in rates and len(rates) == MAX_RANKS:
                    raise KvmemError(f"prefill rates of more than {MAX_RANKS} ranks")
                if math.isfinite(s.value) and s.value > 0:  # else not measured
                    rates[rank] = s.value
            name = wanted.get(s.name)
            if name is None or "tier" not in s.labels:
                continue
            if not 0 <= s.value < LARGEST:  # NaN fails too
                raise KvmemError(f"{s.name} of tier {shown(s.labels['tier'])} is {s.value}: "
                                 "not a count, size or time")
            if s.labels["tier"] not in tiers and len(tiers) == MAX_TIERS:
                raise KvmemError(f"more than {MAX_TIERS} tiers: not kvmem's figures")
            tier = tiers.setdefault(s.labels["tier"], TierFigures(s.labels["tier"]))
            tier.values[name] = tier.values.get(name, 0.0) + s.value
            if name == "failed_loads":
                cause = s.labels.get("cause", "unknown")
                tier.failed_load_causes[cause] = tier.failed_load_causes.get(cause, 0) + s.value
    return Figures(tiers, rates)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def verdict_lines(tier: TierFigures) -> list[str]:
    """What a tier's figures say, for a person."""
    t = tier
    capacity = t.get("capacity_bytes")
    lines = [f"{shown(t.tier)} tier ({format_bytes(int(t.get('used_bytes')))} of "
             f"{format_bytes(int(capacity))} used)"]
    if not t.get("lookups"):
        return [*lines, "  no lookups yet: nothing to judge"]
    lines.append(f"  hit rate {_share(t.hit_rate)} ({t.get('hits'):.0f} of "
                 f"{t.get('lookups'):.0f} blocks looked up); {t.get('hit_tokens'):.0f} "
                 "prompt tokens loaded instead of computed")
    if t.load_gb_per_s is not None:
        lines.append(f"  loads {t.load_gb_per_s:.2f} GB/s ({t.get('loaded_blocks'):.0f} "
                     f"blocks, {t.get('load_seconds'):.3f} s)")
    saved = t.get("prefill_saved_seconds")
    per_gib = t.saved_s_per_gib
    lines.append(f"  prefill saved {saved:.3f} s" + (
        f", {per_gib:.3f} s per GiB of tier memory" if per_gib is not None else ""))
    if t.wasted_share is not None:
        lines.append(f"  stores never loaded {_share(t.wasted_share)} of "
                     f"{t.get('stored_blocks'):.0f} (up to {_share(t.wasted_share_at_most)} "
                     f"if the {t.get('unused_blocks'):.0f} held and not loaded yet never are)")
    failed = [f"{n:.0f} {shown(c, 40)}" for c, n in t.failed_load_causes.items() if n]
    if failed:
        more = f", and {len(failed) - MAX_CAUSES} more causes" if len(failed) > MAX_CAUSES else ""
        lines.append("  failed loads: " + ", ".join(failed[:MAX_CAUSES]) + more)
    lines.append(f"  verdict: {_judgement(t)}")
    return lines


def _judgement(t: TierFigures) -> str:
    if not t.get("hits"):
        return "no hits yet: this tier has cost memory and copies, and saved nothing"
    if t.payback is None or not t.get("prefill_saved_seconds"):
        return "hits, but no prefill rate measured yet to value them"
    if t.payback < 1:
        return (f"loading took longer than recomputing would have ({t.payback:.2f}x): "
                "this tier does not pay")
    return f"pays: its loads saved {t.payback:.1f}x the time they took"
