"""Per-request latency and length histograms (time to first token, inter-token latency,
queue/prefill/decode time, prompt and generation lengths), as vLLM's metrics define them.

Times are ``time.monotonic()`` seconds: a request's arrival is when it was made (before it
queued for the engine thread), it is scheduled the first time a step computes it (later
preemptions do not move that), and its tokens are timed when their step ends. Pure
Python: ``kvmem.serve.metrics`` turns the snapshots into Prometheus histograms.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds in seconds; the last bucket (+Inf) is implicit.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0, 640.0)
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                     0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


def length_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


# name -> (help text, bucket family); the names are vLLM's without the "vllm:" prefix
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival to the first generated token",
                                    "first_token"),
    "inter_token_latency_seconds": ("Time between consecutive generated tokens", "token_gap"),
    "request_time_per_output_token_seconds": ("A request's decode time per token after the "
                                              "first", "token_gap"),
    "e2e_request_latency_seconds": ("Time from arrival to finish", "latency"),
    "request_queue_time_seconds": ("Time from arrival to first being scheduled", "latency"),
    "request_inference_time_seconds": ("Time from first scheduled to the last token",
                                       "latency"),
    "request_prefill_time_seconds": ("Time from first scheduled to the first token", "latency"),
    "request_decode_time_seconds": ("Time from the first token to the last", "latency"),
    "request_prompt_tokens": ("Prompt tokens per finished request", "length"),
    "request_generation_tokens": ("Generated tokens per finished request", "length"),
}


class RequestMetrics:
    """Accumulates the histograms; the engine calls it as requests advance."""

    def __init__(self, max_model_len: int) -> None:
        families = {"first_token": FIRST_TOKEN_BUCKETS, "token_gap": TOKEN_GAP_BUCKETS,
                    "latency": LATENCY_BUCKETS, "length": length_buckets(max_model_len)}
        self.histograms = {name: Histogram(families[family])
                           for name, (_, family) in HISTOGRAMS.items()}

    def scheduled(self, request, now: float) -> None:
        if request.scheduled_time is None:
            request.scheduled_time = now

    def token(self, request, now: float) -> None:
        """A token was generated for ``request`` at ``now``."""
        last = request.last_token_time
        if last is None:
            self.histograms["time_to_first_token_seconds"].observe(now - request.arrival_time)
        else:
            self.histograms["inter_token_latency_seconds"].observe(now - last)
        request.last_token_time = now

    def finished(self, request, now: float) -> None:
        h = self.histograms
        h["e2e_request_latency_seconds"].observe(now - request.arrival_time)
        h["request_prompt_tokens"].observe(request.num_prompt_tokens)
        h["request_generation_tokens"].observe(request.num_output_tokens)
        scheduled = request.scheduled_time
        if scheduled is None:
            return  # aborted or failed while waiting
        h["request_queue_time_seconds"].observe(scheduled - request.arrival_time)
        first, last = request.first_token_time, request.last_token_time
        if first is None or last is None:
            return
        h["request_prefill_time_seconds"].observe(first - scheduled)
        h["request_decode_time_seconds"].observe(last - first)
        h["request_inference_time_seconds"].observe(last - scheduled)
        if request.num_output_tokens > 1:
            h["request_time_per_output_token_seconds"].observe(
                (last - first) / (request.num_output_tokens - 1))

    def snapshot(self) -> dict[str, Histogram]:
        return {name: h.copy() for name, h in self.histograms.items()}
