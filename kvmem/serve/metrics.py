"""Prometheus metrics read from the engine's latest snapshot at scrape time.

A collector (rather than counters updated in the request path) keeps the numbers
consistent with each other: they all come from the same step of the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvmem.engine.errors import FAILURE_STAGES
from kvmem.engine.llm_engine import EngineSnapshot
from kvmem.engine.request_metrics import HISTOGRAMS


class EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        labels = ["model_name"]
        m = [self._model]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(m, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(m, value)
            return g

        yield counter("kvmem_requests_received", "Requests accepted by the engine",
                      s.received_requests)
        finished = CounterMetricFamily("kvmem_requests_finished", "Finished requests",
                                       labels=[*labels, "finish_reason"])
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric([*m, reason], s.finished_requests.get(reason, 0))
        yield finished
        failed = CounterMetricFamily(
            "kvmem_requests_failed", "Requests that failed alone, by the stage that failed "
            "(the engine served the others on)", labels=[*labels, "stage"])
        for stage in FAILURE_STAGES:
            failed.add_metric([*m, stage], s.failed_requests.get(stage, 0))
        yield failed
        yield counter("kvmem_prompt_tokens", "Prompt tokens of finished requests",
                      s.prompt_tokens)
        yield counter("kvmem_generation_tokens", "Generated tokens", s.generation_tokens)
        yield counter("kvmem_preemptions", "Requests preempted (KV recomputed later)",
                      s.num_preemptions)
        yield counter("kvmem_engine_steps", "Engine steps (model forward passes)", s.steps)
        yield gauge("kvmem_num_requests_running", "Requests in the running queue", s.num_running)
        yield gauge("kvmem_num_requests_waiting", "Requests in the waiting queue", s.num_waiting)
        blocks = GaugeMetricFamily("kvmem_kv_blocks", "KV cache blocks by state",
                                   labels=[*labels, "state"])
        blocks.add_metric([*m, "used"], s.kv_blocks_used)
        blocks.add_metric([*m, "free"], s.kv_blocks_free)
        blocks.add_metric([*m, "cached"], s.kv_blocks_cached)
        yield blocks
        yield gauge("kvmem_kv_blocks_total", "KV cache blocks in the pool", s.kv_blocks_total)
        yield gauge("kvmem_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield counter("kvmem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_queried_tokens)
        yield counter("kvmem_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      s.prefix_hit_tokens)
        yield gauge("kvmem_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens)",
                    s.prefix_hit_rate)
        yield from _offload_metrics(s, labels, m)
        yield from _histograms(s, labels, m)


def _histograms(s: EngineSnapshot, labels: list[str], m: list[str]) -> Iterator[Metric]:
    for name, (doc, _) in HISTOGRAMS.items():
        h = s.histograms.get(name)
        if h is None:
            continue
        family = HistogramMetricFamily(f"kvmem_{name}", doc, labels=labels)
        cumulative, buckets = 0, []
        for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family.add_metric(m, buckets, h.total)
        yield family


# kvmem.tiers.TierStats fields, exported per tier as kvmem_offload_<field>{tier="cpu"|"disk"}
_OFFLOAD_COUNTERS = {
    "hits": "KV blocks a prefix lookup found in this tier",
    "misses": "KV blocks a prefix lookup looked for in this tier and did not find",
    "stored_blocks": "KV blocks written into this tier",
    "bytes_stored": "Bytes written into this tier",
    "bytes_loaded": "Bytes loaded from this tier into the KV cache",
    "skipped_stores": "Stores dropped (tier full or busy, write error, tier disabled)",
    "not_admitted": "Stores the admission policy turned down",
    "failed_loads": "Loads that failed (missing file, bad checksum, another namespace's file, "
                    "read error)",
    "evictions": "KV blocks evicted from this tier",
    "skipped_files": "Entries of the disk tier's folder that are not its regular files "
                     "(directories, links), left alone",
}
_OFFLOAD_GAUGES = {
    "used_bytes": "Bytes this tier holds now",
    "capacity_bytes": "This tier's byte budget",
    "enabled": "1 while this tier is in use (a failed disk turns it off)",
}


def _offload_metrics(s: EngineSnapshot, labels: list[str], m: list[str]) -> Iterator[Metric]:
    if not s.offload:
        return
    for fields, family in ((_OFFLOAD_COUNTERS, CounterMetricFamily),
                           (_OFFLOAD_GAUGES, GaugeMetricFamily)):
        for name, doc in fields.items():
            metric = family(f"kvmem_offload_{name}", doc, labels=[*labels, "tier"])
            for tier, stats in s.offload.items():
                metric.add_metric([*m, tier], float(getattr(stats, name)))
            yield metric


def make_registry(snapshot: Callable[[], EngineSnapshot], model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(snapshot, model_name))
    return registry
