"""The server's Prometheus metrics: what ``/metrics`` shows.

Decides the metric names and buckets. Gauges read the scheduler's snapshot when scraped (so
they are never stale); counters and histograms are fed by the scheduler as its
:class:`~fuel.runtime.scheduler.Observer` (thread-safe: prometheus_client locks). Each server
has its own registry, so several servers can live in one process (tests).

Invariants: ``fuel_kv_blocks_used + fuel_kv_blocks_free == fuel_kv_blocks_total``; the tokens/s
gauge is generated tokens over the last ``window`` seconds.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from fuel.runtime.scheduler import Finish, Scheduler

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, window: float = 10.0):
        self.registry = CollectorRegistry()
        self.window = window
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        r = self.registry
        self.queue = Gauge("fuel_queue_length", "Requests waiting for admission", registry=r)
        self.running = Gauge("fuel_running_sequences", "Sequences in the running batch", registry=r)
        self.blocks_used = Gauge("fuel_kv_blocks_used", "KV cache blocks held by sequences", registry=r)
        self.blocks_free = Gauge("fuel_kv_blocks_free", "KV cache blocks free", registry=r)
        self.blocks_total = Gauge("fuel_kv_blocks_total", "KV cache blocks", registry=r)
        self.rate = Gauge("fuel_generation_tokens_per_second",
                          "Generated tokens per second over the last window", registry=r)
        self.generated = Counter("fuel_generation_tokens", "Generated tokens", registry=r)
        self.prompt = Counter("fuel_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.requests = Counter("fuel_requests", "Finished requests by finish reason", ["finish"], registry=r)
        self.ttft = Histogram("fuel_time_to_first_token_seconds", "Submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.builds = Gauge("fuel_program_builds", "Step programs built so far (lower + optimize); "
                            "a new batch shape or block width builds one", registry=r)
        self.itl = Histogram("fuel_inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)

    def bind(self, scheduler: Scheduler) -> None:
        snap = scheduler.snapshot
        self.queue.set_function(lambda: snap().waiting)
        self.running.set_function(lambda: snap().running)
        self.blocks_used.set_function(lambda: snap().kv_blocks_used)
        self.blocks_free.set_function(lambda: snap().kv_blocks_total - snap().kv_blocks_used)
        self.blocks_total.set_function(lambda: snap().kv_blocks_total)
        self.rate.set_function(self._rate)
        self.builds.set_function(lambda: sum(scheduler.engine.stats.builds.values()))

    # -- the scheduler's Observer ---------------------------------------------------------------

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def tokens(self, count: int) -> None:
        self.generated.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def finished(self, reason: Finish) -> None:
        self.requests.labels(reason.value).inc()

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window:
                self._recent.popleft()
            return sum(count for _, count in self._recent) / self.window

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["LATENCY_BUCKETS", "Metrics"]
