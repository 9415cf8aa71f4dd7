"""Server metrics, through prometheus_client: `pmx_*` counters, gauges and histograms at `/metrics`.

Two processes keep them. The engine (rank 0) counts what its steps do (:class:`EngineStats`: tokens, preemptions, the
prefix cache, speculative decoding, the queue and the KV cache) and sends a snapshot to the front end with its output
(every STATS_PERIOD_S, whenever a request is admitted, cancelled or finished, and when it goes idle). The front end (:class:`FrontendMetrics`) counts what its
clients see: requests by finish reason, refusals, HTTP responses by status code, time to first token and between
tokens (measured where the tokens reach the HTTP side); it serves the engine's latest snapshot beside its own.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "pmx"
STATS_PERIOD_S = 0.25
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5)
FINISH_REASONS = ("stop", "length", "abort", "error")

ENGINE_COUNTERS = {  # name: help
    "prompt_tokens_total": "Prompt tokens of the requests admitted.",
    "generation_tokens_total": "Tokens generated.",
    "preemptions_total": "Sequences preempted (their cache freed, recomputed later) for lack of KV pages.",
    "prefix_cache_queries_total": "KV pages of prompts looked up in the prefix cache.",
    "prefix_cache_hits_total": "KV pages of prompts found in the prefix cache (PAGE_SIZE tokens not computed each).",
    "prefix_cache_tokens_saved_total": "Prompt tokens taken from the prefix cache instead of computed.",
    "spec_decode_draft_tokens_total": "Tokens guessed by speculative decoding and verified.",
    "spec_decode_accepted_tokens_total": "Guessed tokens accepted (the acceptance rate: accepted / draft).",
    "steps_total": "Engine steps run.",
}
ENGINE_GAUGES = {
    "requests_waiting": "Sequences waiting for admission (the queue).",
    "requests_running": "Sequences in the running batch.",
    "kv_pages_used": "KV-cache pages in use.",
    "kv_pages_free": "KV-cache pages free.",
    "kv_pages_total": "KV-cache pages in all.",
    "kv_page_tokens": "Tokens per KV-cache page.",
}


class EngineStats:
    """The engine's counters and gauges (one thread: the engine loop's)."""

    def __init__(self):
        self.values = {name: 0 for name in (*ENGINE_COUNTERS, *ENGINE_GAUGES)}

    def inc(self, name: str, value: float = 1) -> None:
        if name not in ENGINE_COUNTERS:
            raise KeyError(name)
        self.values[name] += value

    def set(self, **gauges) -> None:
        for k, v in gauges.items():
            if k not in ENGINE_GAUGES:
                raise KeyError(k)
            self.values[k] = v

    def get(self, name: str) -> float:
        return self.values[name]

    def snapshot(self) -> dict:
        return dict(self.values)


class _EngineCollector:
    """The engine's latest snapshot as Prometheus metrics."""

    def __init__(self):
        self.values = EngineStats().snapshot()

    def collect(self):
        for name, helptext in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", helptext, value=self.values.get(name, 0))
        for name, helptext in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", helptext, value=self.values.get(name, 0))


class FrontendMetrics:
    """The front end's metrics in a registry of their own, the engine's snapshot among them."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests finished, by finish reason (stop, length, abort, "
                                                      "error).", ["reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused before they ran (bad request, "
                                                               "queue full, shutting down).", registry=r)
        self.responses = Counter(f"{PREFIX}_http_responses", "HTTP responses by status code (a stream counts when "
                                                             "it starts).", ["code"], registry=r)
        self.disconnects = Counter(f"{PREFIX}_client_disconnects", "Clients that went away before their answer "
                                                                   "(or while reading their request).", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between successive tokens of a sequence.",
                             buckets=ITL_BUCKETS, registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)

    def observe_latency(self, ttft: Optional[float], itl: Optional[float], more: int = 0) -> None:
        """A delta's tokens reached the front end: the first of a completion (ttft), or a later one (itl); `more`
        tokens came with it (a step's accepted guesses: 0 s after it)."""
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)
        for _ in range(more):
            self.itl.observe(0.0)

    def finished(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def update_engine(self, snapshot: dict) -> None:
        self.engine.values = snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)
