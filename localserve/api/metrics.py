"""What the request path records: Prometheus counters and latencies measured here, engine gauges
read at scrape time. Serving them over HTTP (/metrics, the counting middleware) is server/metrics.py.

Each app gets its own CollectorRegistry: the process-global default registry would refuse a second
app in the same process (tests build many) with "Duplicated timeseries". Engine figures (queue
depth per lane, running sequences, KV use, prefix-cache hits) are read from each loaded model's
`engine.stats()` snapshot only when /metrics is scraped, so serving requests costs nothing extra.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..protocol.requests import LANES, Usage
from .live import ORIGIN, LatencyRings, LiveRequests


class EngineCollector(Collector):
    """Gauges from ModelManager.status() rows (each carrying the engine's stats dict)."""

    def __init__(self, status: StatusSource):
        self.status = status

    def collect(self) -> Iterable[Any]:
        running = GaugeMetricFamily("localserve_running_sequences", "Sequences in the running batch", labels=["model"])
        waiting = GaugeMetricFamily("localserve_queue_depth", "Requests waiting per lane", labels=["model", "lane"])
        occupancy = GaugeMetricFamily("localserve_batch_occupancy", "Running sequences / max sequences", labels=["model"])
        kv_used = GaugeMetricFamily("localserve_kv_cells_used", "KV cache cells in use", labels=["model"])
        kv_total = GaugeMetricFamily("localserve_kv_cells_total", "KV cache cells", labels=["model"])
        tps = GaugeMetricFamily("localserve_engine_tokens_per_second", "Recent decode throughput", labels=["model"])
        threads = GaugeMetricFamily("localserve_compute_threads",
                                    "Threads the engine computes with now (fewer while other processes hold cores)",
                                    labels=["model"])
        hits = CounterMetricFamily("localserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                   labels=["model"])
        queries = CounterMetricFamily("localserve_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                                      labels=["model"])
        moves = CounterMetricFamily("localserve_kv_moves", "Sequences whose KV moved to keep running ids consecutive",
                                    labels=["model"])
        interrupted = CounterMetricFamily("localserve_interrupted_steps",
                                          "Batch-lane steps stopped for an arriving request and redone", labels=["model"])
        drafted = CounterMetricFamily("localserve_draft_tokens", "Speculative draft tokens verified",
                                      labels=["model", "lane"])
        accepted = CounterMetricFamily("localserve_draft_accepted_tokens", "Speculative draft tokens accepted",
                                       labels=["model", "lane"])
        loaded = GaugeMetricFamily("localserve_models_loaded", "Models loaded")
        restarts = CounterMetricFamily("localserve_engine_restarts", "Engine worker processes that died, per model",
                                       labels=["model"])
        every = self.status()
        for row in every:
            if "restarts" in row:
                restarts.add_metric([str(row.get("name", "?"))], _num(row["restarts"]))
        rows = [r for r in every if r.get("state", "loaded") in ("loaded", "remote")]
        loaded.add_metric([], sum(1 for r in rows if r.get("state", "loaded") == "loaded"))
        for row in rows:
            model = str(row.get("name", "?"))
            stats = row.get("stats") or {}
            n_running = _num(stats.get("running", row.get("running", 0)))
            running.add_metric([model], n_running)
            lanes = stats.get("waiting", row.get("waiting")) or {}
            for lane in LANES:
                waiting.add_metric([model, lane], _num(lanes.get(lane, 0)) if isinstance(lanes, dict) else 0)
            max_seq = _num(stats.get("max_sequences", 0))
            if max_seq:
                occupancy.add_metric([model], n_running / max_seq)
            kv_used.add_metric([model], _num(stats.get("kv_used", 0)))
            kv_total.add_metric([model], _num(stats.get("kv_total", 0)))
            tps.add_metric([model], _num(stats.get("tokens_per_s", 0)))
            if stats.get("compute_threads"):
                threads.add_metric([model], _num(stats["compute_threads"]))
            hits.add_metric([model], _num(stats.get("prefix_cache_hits", 0)))
            queries.add_metric([model], _num(stats.get("prefix_cache_queries", 0)))
            moves.add_metric([model], _num(stats.get("kv_moves", 0)))
            interrupted.add_metric([model], _num(stats.get("interrupted_steps", 0)))
            for family, key in ((drafted, "draft_tokens"), (accepted, "draft_accepted")):
                per_lane = stats.get(key) or {}
                for lane in LANES:
                    family.add_metric([model, lane], _num(per_lane.get(lane, 0)) if isinstance(per_lane, dict) else 0)
        return [loaded, running, waiting, occupancy, kv_used, kv_total, tps, threads, hits, queries, moves,
                interrupted, drafted, accepted, restarts]


class UpstreamCollector(Collector):
    """Each remote upstream's state (upstream/pool.py rows): up, outstanding, failures, errors."""

    def __init__(self, status: StatusSource):
        self.status = status

    def collect(self) -> Iterable[Any]:
        up = GaugeMetricFamily("localserve_upstream_up", "1 while the upstream is in service", labels=["upstream"])
        outstanding = GaugeMetricFamily("localserve_upstream_outstanding", "Our requests in flight there",
                                        labels=["upstream"])
        failures = GaugeMetricFamily("localserve_upstream_consecutive_failures", "Failed checks/requests in a row",
                                     labels=["upstream"])
        served = CounterMetricFamily("localserve_upstream_requests", "Requests the upstream answered", labels=["upstream"])
        errors = CounterMetricFamily("localserve_upstream_errors", "Failures that took it out", labels=["upstream"])
        for row in self.status():
            name = [str(row["name"])]
            up.add_metric(name, 0.0 if row.get("state") == "down" else 1.0)
            outstanding.add_metric(name, _num(row.get("outstanding")))
            failures.add_metric(name, _num(row.get("failures")))
            served.add_metric(name, _num(row.get("served")))
            errors.add_metric(name, _num(row.get("errors")))
        return [up, outstanding, failures, served, errors]


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


class Metrics:
    def __init__(self, status: StatusSource):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("localserve_http_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.in_flight = Gauge("localserve_http_requests_in_flight", "HTTP requests being answered", registry=r)
        self.duration = Histogram("localserve_http_request_duration_seconds", "Time to the full answer",
                                  ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("localserve_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.ttft = Histogram("localserve_time_to_first_token_seconds", "Submit to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("localserve_inter_token_latency_seconds", "Time between streamed tokens", ["model"],
                             buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram("localserve_queue_seconds", "Submit to first scheduled step", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(status))
        # The dashboard's exact recent figures and the requests in flight (live.py).
        self.rings = LatencyRings()
        self.live = LiveRequests()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_usage(self, model: str, usage: Usage | None) -> None:
        if usage is None:
            return
        self.tokens.labels(model, "prompt").inc(usage.prompt_tokens)
        self.tokens.labels(model, "completion").inc(usage.completion_tokens)
        self.tokens.labels(model, "cached").inc(usage.cached_tokens)
        if usage.completion_tokens:
            self.ttft.labels(model).observe(usage.ttft_s)
        self.queue_time.labels(model).observe(usage.queue_s)
        origin = ORIGIN.get()
        lane = origin.lane if origin else "default"
        self.rings.add(model, "queue", lane, usage.queue_s)
        streamed = origin is not None and origin.first_token
        self.live.lane_tokens[lane] += usage.prompt_tokens + (0 if streamed else usage.completion_tokens)
        if usage.completion_tokens and not streamed:
            # Not streamed: the first token's time at the edge is the answer's end less the engine's
            # time from first token to finish (usage.total_s - usage.ttft_s, both from submit).
            ttft = usage.ttft_s
            if origin is not None:
                ttft = max(0.0, time.perf_counter() - origin.started - (usage.total_s - usage.ttft_s))
            self.rings.add(model, "ttft", lane, ttft)

    def token_timer(self, model: str) -> "TokenTimer":
        return TokenTimer(self, model)


class TokenTimer:
    """Latency as a streaming client sees it: the first token's time since the request arrived
    (TTFT), and the time between events, per token (ITL)."""

    def __init__(self, metrics: Metrics, model: str):
        self.histogram = metrics.itl.labels(model)
        self.rings = metrics.rings
        self.lane_tokens = metrics.live.lane_tokens
        self.model = model
        self.origin = ORIGIN.get()
        self.lane = self.origin.lane if self.origin else "default"
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        at = time.monotonic()
        self.lane_tokens[self.lane] += n
        if self.last is not None:
            gap = (now - self.last) / n
            for _ in range(n):
                self.histogram.observe(gap)
                self.rings.add(self.model, "itl", self.lane, gap, at)
        elif self.origin is not None and not self.origin.first_token:
            self.origin.first_token = True
            self.rings.add(self.model, "ttft", self.lane, now - self.origin.started, at)
        self.last = now


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


StatusSource = Callable[[], list[dict[str, Any]]]
