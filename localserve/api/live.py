"""The live side of the dashboard: which request came from where, and exact recent latencies.

- `Origin`: who asked (dialect, route) and when the request arrived, set for the handler's task by
  the server's middleware (a batch line sets its own), in the `ORIGIN` context variable; so the
  request path keeps its signatures and `generation()` reads it where the streams are known.
- `LiveRequests`: the generations in flight (model, lane, origin, stream: what a dashboard row
  shows, and what "cancel" ends), requests counted per dialect and route, tokens per lane.
- `LatencyRings`: TTFT, ITL, queue wait and step time as samples in a bounded ring per model and
  figure, read as exact percentiles over the last minute and the last 15 minutes. The Prometheus
  histograms (metrics.py) stay for scraping: their buckets cannot say a p95 to the millisecond.

TTFT here is what a client sees: from the request's arrival to its first token (tokenizing and the
template included); ITL is the gap between the events a stream writes, per token. Everything is
plain counters and deques written on the event loop: no lock, no cost to the engine thread.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter, deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any, Iterable, Sequence

from ..protocol.engine import EventStream, ModelEngine
from .dialects import ROUTES
from ..protocol.requests import LANES

WINDOWS_S = {"1m": 60.0, "15m": 900.0}
FIGURES = ("ttft", "itl", "queue", "step")
# Samples kept per model, figure and lane: 15 minutes of four streams' ITL at ~20 tokens/s each is
# 72,000; a ring of this size covers the last minute of any load this machine serves and the 15
# minutes of a moderate one (the snapshot says how many samples each window holds).
RING_SIZE = 16_384
LONG_REFRESH_S = 15.0  # the 15-minute percentiles of a large ring are recomputed this often
ALWAYS_FRESH_SAMPLES = 8_192  # a figure with at most this many samples is recomputed at every snapshot
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}

@dataclass
class Origin:
    """Who sent the request in this task, and what it became once its generation started."""

    dialect: str
    route: str
    started: float = field(default_factory=time.perf_counter)
    lane: str = "default"
    first_token: bool = False  # a stream's first token was timed (TTFT is not taken from usage then)
    cancelled_by: str | None = None  # "dashboard": a user ended it from the page
    tracker: "LiveRequests | None" = None  # where generation() lists its streams


ORIGIN: ContextVar[Origin | None] = ContextVar("localserve_origin", default=None)


def origin_for(route: str, tracker: "LiveRequests") -> Origin | None:
    """The origin of a request to `route`, or None for a route that generates nothing."""
    dialect = ROUTES.get(route)  # the generating routes (api/dialects.py)
    return Origin(dialect.name, route, tracker=tracker) if dialect else None


def mark_fim() -> None:
    """The current request is fill-in-the-middle (a `suffix` on /v1/completions or /api/generate):
    editors send those, and the dashboard counts them with the other FIM routes."""
    origin = ORIGIN.get()
    if origin is not None and origin.dialect != "batch":  # a batch line stays counted as batch
        origin.dialect = "fim"


def cancelled_by() -> str | None:
    origin = ORIGIN.get()
    return origin.cancelled_by if origin is not None else None


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The q-quantile of sorted samples, interpolated between the two nearest ranks (numpy's
    default); None for no samples."""
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(ordered: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p95, p99 and the count of samples already sorted."""
    out: dict[str, float | int | None] = {name: percentile(ordered, q) for name, q in QUANTILES.items()}
    out["n"] = len(ordered)
    return out


class _Ring:
    """One model's samples of one figure in one lane: times (monotonic, ascending) and values."""

    __slots__ = ("times", "values")

    def __init__(self, size: int) -> None:
        self.times: deque[float] = deque(maxlen=size)
        self.values: deque[float] = deque(maxlen=size)

    def since(self, start: float) -> list[float]:
        # bisect and islice run in C: no Python loop over the samples.
        return list(islice(self.values, bisect_left(self.times, start), None))


class LatencyRings:
    """Per model, figure and lane, the last `size` samples. The last minute's percentiles are
    computed at every snapshot; the 15 minutes', which move slowly, too while a figure holds few
    samples, else every LONG_REFRESH_S, one figure per snapshot: sorting up to 3 x RING_SIZE samples is the one costly part, and spread so
    it never stalls the event loop for all four figures at once."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.size = size
        self._rings: dict[tuple[str, str, str], _Ring] = {}
        self._long: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}  # (model, figure) -> (when, window)

    def add(self, model: str, figure: str, lane: str, seconds: float, at: float | None = None) -> None:
        """Samples of one figure arrive in time order (windows are found by bisection)."""
        ring = self._rings.get((model, figure, lane))
        if ring is None:
            ring = self._rings[(model, figure, lane)] = _Ring(self.size)
        ring.times.append(time.monotonic() if at is None else at)
        ring.values.append(seconds)

    def _count(self, model: str, figure: str) -> int:
        return sum(len(ring.values) for (m, f, _), ring in self._rings.items() if m == model and f == figure)

    def _window(self, model: str, figure: str, start: float) -> dict[str, Any]:
        by_lane = {lane: ring.since(start) for (m, f, lane), ring in self._rings.items() if m == model and f == figure}
        for values in by_lane.values():
            values.sort()
        # Sorted runs laid end to end: the sort of all of them merges the runs (timsort), near-linear.
        window = {"all": summarize(sorted(chain.from_iterable(by_lane.values())))}
        window.update({lane: summarize(by_lane.get(lane, [])) for lane in LANES})
        return window

    def summary(self, model: str, now: float | None = None) -> dict[str, Any]:
        """{figure: {window: {"all" | lane: {p50, p95, p99, n}}}} for this model."""
        now = time.monotonic() if now is None else now
        long = {figure: self._long.get((model, figure)) for figure in FIGURES}
        # Small rings cost nothing to sort: always fresh. Large ones wait their turn.
        missing = [figure for figure, cached in long.items()
                   if cached is None or self._count(model, figure) <= ALWAYS_FRESH_SAMPLES]
        stale = sorted((cached[0], figure) for figure, cached in long.items()
                       if cached is not None and now - cached[0] >= LONG_REFRESH_S)
        # At most one figure's 15 minutes are sorted again per snapshot (all of them the first time).
        for figure in missing or [figure for _, figure in stale[:1]]:
            long[figure] = self._long[(model, figure)] = (now, self._window(model, figure, now - WINDOWS_S["15m"]))
        return {figure: {"1m": self._window(model, figure, now - WINDOWS_S["1m"]), "15m": long[figure][1]}
                for figure in FIGURES}


@dataclass
class Tracked:
    """One generation's requests in flight, as a dashboard row shows them (never their content)."""

    model: str
    engine: ModelEngine
    stream: EventStream
    origin: Origin


class LiveRequests:
    """What is running now and where it came from. Written on the event loop only."""

    def __init__(self) -> None:
        self.entries: dict[str, Tracked] = {}
        self.traffic: Counter[tuple[str, str]] = Counter()
        self.lane_tokens: Counter[str] = Counter()

    def count(self, origin: Origin) -> None:
        self.traffic[(origin.dialect, origin.route)] += 1

    def track(self, origin: Origin, model: str, engine: ModelEngine, streams: Sequence[EventStream]) -> list[str]:
        ids = [stream.request_id for stream in streams]
        for stream in streams:
            self.entries[stream.request_id] = Tracked(model, engine, stream, origin)
        return ids

    def untrack(self, ids: Iterable[str]) -> None:
        for request_id in ids:
            self.entries.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """End that request's stream, as a client leaving would (its dialect's cancellation follows);
        False when no such request runs."""
        entry = self.entries.get(request_id)
        if entry is None:
            return False
        entry.origin.cancelled_by = "dashboard"
        entry.stream.cancel()
        return True

    def of_model(self, model: str) -> dict[str, Tracked]:
        return {rid: t for rid, t in self.entries.items() if t.model == model}

    def traffic_rows(self) -> list[dict[str, Any]]:
        return [{"dialect": d, "route": r, "requests": n} for (d, r), n in sorted(self.traffic.items())]
