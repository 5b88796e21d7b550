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
from kvmem.tiers.stats import (
    COUNTERS,
    FAILED_LOAD_CAUSES,
    GAUGES,
    PREFILL_RATE,
    capacity_samples,
    metric_name,
)


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
        yield from _elastic_metrics(s, labels, m)
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


def _offload_metrics(s: EngineSnapshot, labels: list[str], m: list[str]) -> Iterator[Metric]:
    """The tiers' figures under the names vLLM's ``/metrics`` shows for ``KvmemConnector``
    (``kvmem.tiers.stats``), so one dashboard reads both."""
    if not s.offload:
        return
    for fields, family in ((COUNTERS, CounterMetricFamily), (GAUGES, GaugeMetricFamily)):
        for name, doc in fields.items():
            if name == "failed_loads":
                metric = family(metric_name(name), doc, labels=[*labels, "tier", "cause"])
                for tier, stats in s.offload.items():
                    for cause in FAILED_LOAD_CAUSES:
                        metric.add_metric([*m, tier, cause],
                                          float(stats.failed_load_causes.get(cause, 0)))
            else:
                metric = family(metric_name(name), doc, labels=[*labels, "tier"])
                for tier, stats in s.offload.items():
                    metric.add_metric([*m, tier], float(getattr(stats, name)))
            yield metric
    capacity: dict[str, GaugeMetricFamily] = {}
    for tier, stats in s.offload.items():
        for name, doc, kind, value in capacity_samples(stats.as_dict()):
            family = capacity.setdefault(name, GaugeMetricFamily(
                name, doc, labels=[*labels, "tier", "kind"]))
            family.add_metric([*m, tier, kind], value)
    yield from capacity.values()
    if s.prefill_rate is not None:
        rate = GaugeMetricFamily(PREFILL_RATE[0], PREFILL_RATE[1], labels=labels)
        rate.add_metric(m, s.prefill_rate)
        yield rate


# kvmem.memory.ElasticStats fields, exported as kvmem_kv_memory_<name> with elastic memory;
# the same figures `kvmem top` shows for every engine on the device
_ELASTIC_GAUGES = {
    "floor_bytes": ("floor_bytes", "Bytes reserved for this engine under the device total"),
    "ceiling_bytes": ("ceiling_bytes", "Most KV bytes this engine may map (its ceiling)"),
    "allowed_bytes": ("limit_bytes", "Most KV bytes this engine may hold now (ceiling and "
                                     "device total)"),
    "mapped_bytes": ("held_bytes", "KV bytes this engine holds (mapped pages)"),
    "live_bytes": ("live_bytes", "Bytes of blocks running requests hold"),
    "cached_bytes": ("cached_bytes", "Bytes of cached-free blocks (prefix cache)"),
}
_ELASTIC_COUNTERS = {
    "reclaimed_bytes": ("reclaimed_bytes", "Bytes given back to other engines"),
    "reclaims": ("reclaims", "Times this engine gave memory back to other engines"),
}


def _elastic_metrics(s: EngineSnapshot, labels: list[str], m: list[str]) -> Iterator[Metric]:
    e = s.elastic
    if e is None:
        return
    values = e.__dict__
    for fields, family in ((_ELASTIC_GAUGES, GaugeMetricFamily),
                           (_ELASTIC_COUNTERS, CounterMetricFamily)):
        for name, (key, doc) in fields.items():
            if values[key] is None:
                continue
            metric = family(f"kvmem_kv_memory_{name}", doc, labels=labels)
            metric.add_metric(m, float(values[key]))
            yield metric


def make_registry(snapshot: Callable[[], EngineSnapshot], model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(snapshot, model_name))
    return registry
