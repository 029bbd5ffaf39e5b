"""Prometheus metrics in the text exposition format, written by hand (a few counters and
histograms do not justify a dependency).

Counters and histograms are updated by the routes on the event loop thread only, so no locks.
Gauges (KV usage, queue lengths, cache hit rate) are read from `engine.stats()` at scrape time.
Names follow the `sgl_` prefix with Prometheus conventions (`_total`, `_seconds`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Metrics", "Histogram"]

# Seconds. CPU serving of small models spans milliseconds to tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative); last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            running += n
            le = "+Inf" if math.isinf(bound) else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {self.total!r}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats
        self.requests: dict[tuple[str, str], int] = {}  # (route, outcome) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.aborted = 0
        self.ttft = Histogram("sgl_time_to_first_token_seconds",
                              "Time from request arrival to its first output token.", LATENCY_BUCKETS)
        self.itl = Histogram("sgl_inter_token_latency_seconds",
                             "Time between consecutive streamed output chunks of one sample.", ITL_BUCKETS)
        self.e2e = Histogram("sgl_e2e_request_latency_seconds",
                             "Time from request arrival to its last output token.", LATENCY_BUCKETS)

    def count_request(self, route: str, outcome: str) -> None:
        key = (route, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def count_output(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                     aborted: bool = False) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        self.cached_tokens += cached_tokens
        self.aborted += int(aborted)

    def render(self) -> str:
        lines: list[str] = []

        def scalar(name: str, kind: str, help_: str, value: float) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value!r}"])

        lines += ["# HELP sgl_requests_total HTTP generation requests by route and outcome.",
                  "# TYPE sgl_requests_total counter"]
        for (route, outcome), n in sorted(self.requests.items()):
            lines.append(f'sgl_requests_total{{route="{route}",outcome="{outcome}"}} {n}')
        scalar("sgl_prompt_tokens_total", "counter", "Prompt tokens of finished samples.", self.prompt_tokens)
        scalar("sgl_generation_tokens_total", "counter", "Output tokens generated.", self.generation_tokens)
        scalar("sgl_cached_prompt_tokens_total", "counter",
               "Prompt tokens whose KV came from the radix cache.", self.cached_tokens)
        scalar("sgl_aborted_samples_total", "counter",
               "Samples aborted (client disconnect, timeout, engine error).", self.aborted)
        s = self._stats()
        scalar("sgl_cache_hit_rate", "gauge",
               "Cached prompt tokens / prompt tokens over finished requests (engine-wide).",
               float(s.cache_hit_rate))
        scalar("sgl_kv_used_tokens", "gauge", "KV pool slots in use (running + cached).",
               s.kv_used_tokens)
        scalar("sgl_kv_total_tokens", "gauge", "KV pool capacity in tokens.", s.kv_total_tokens)
        scalar("sgl_kv_usage_ratio", "gauge", "Share of the KV pool in use.",
               s.kv_used_tokens / s.kv_total_tokens if s.kv_total_tokens else 0.0)
        scalar("sgl_kv_cached_tokens", "gauge", "Tokens held by the radix cache.", s.kv_cached_tokens)
        scalar("sgl_num_running_reqs", "gauge", "Requests decoding now.", s.running)
        scalar("sgl_num_waiting_reqs", "gauge", "Requests queued for admission.", s.waiting)
        scalar("sgl_gen_throughput", "gauge", "Output tokens per second over the last 10 s.",
               float(s.tokens_per_s))
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        return "\n".join(lines) + "\n"
