"""Server metrics in Prometheus' text format (counters, gauges and histograms, no client library).

The engine thread updates them; `/metrics` reads them from the HTTP thread under the same lock.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

PREFIX = "pmx"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)   # the last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    COUNTERS = {  # name: help
        "requests_total": "Requests finished, by finish reason (stop, length, abort).",
        "requests_rejected_total": "Requests refused before they ran (bad request, queue full, shutting down).",
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
    GAUGES = {
        "requests_waiting": "Sequences waiting for admission (the queue).",
        "requests_running": "Sequences in the running batch.",
        "kv_pages_used": "KV-cache pages in use.",
        "kv_pages_free": "KV-cache pages free.",
        "kv_pages_total": "KV-cache pages in all.",
        "kv_page_tokens": "Tokens per KV-cache page.",
    }

    def __init__(self):
        self.lock = threading.Lock()
        self.counters = {name: {} for name in self.COUNTERS}   # name -> {label value or "": count}
        self.gauges = {name: 0 for name in self.GAUGES}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def inc(self, name: str, value: float = 1, label: str = "") -> None:
        with self.lock:
            c = self.counters[name]
            c[label] = c.get(label, 0) + value

    def set(self, **gauges) -> None:
        with self.lock:
            for k, v in gauges.items():
                if k not in self.gauges:
                    raise KeyError(k)
                self.gauges[k] = v

    def observe(self, ttft=(), itl=()) -> None:
        with self.lock:
            for v in ttft:
                self.ttft.observe(v)
            for v in itl:
                self.itl.observe(v)

    def get(self, name: str, label: str = "") -> float:
        with self.lock:
            if name in self.gauges:
                return self.gauges[name]
            return self.counters[name].get(label, 0)

    def render(self) -> str:
        lines = []
        with self.lock:
            for name, helptext in self.COUNTERS.items():
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {helptext}", f"# TYPE {full} counter"]
                values = self.counters[name] or {"": 0}
                for label, v in sorted(values.items()):
                    sel = f'{{reason="{label}"}}' if label else ""
                    lines.append(f"{full}{sel} {v}")
            for name, helptext in self.GAUGES.items():
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {helptext}", f"# TYPE {full} gauge", f"{full} {self.gauges[name]}"]
            for full, helptext, h in (
                    (f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token.", self.ttft),
                    (f"{PREFIX}_inter_token_latency_seconds", "Time between successive tokens of a sequence.",
                     self.itl)):
                lines += [f"# HELP {full} {helptext}", f"# TYPE {full} histogram", *h.lines(full)]
        return "\n".join(lines) + "\n"
