"""The upstreams of this daemon: one HTTP client session, each upstream's health, its slots.

- Slots: an upstream serves at most `max_concurrency` of our requests at once. The rest wait here
  in one queue ordered by lane (interactive, default, batch), then arrival; a freed slot goes to
  the best waiter that upstream can serve, so an interactive request overtakes queued batch work
  exactly as on a local model. A waiter for a model several upstreams serve takes the healthy one
  with the fewest requests outstanding (least-outstanding-requests).
- Health: every upstream that is up is checked each `upstream_health_interval` (GET /models). A
  failed check or a failed request takes it out; it is probed again after a backoff doubling from
  1 s to 60 s, and comes back on the first success. While every upstream of a model is out, its
  requests fail at once (503 + Retry-After) rather than wait for an outage of unknown length.
- The session is created and closed with the app (server/app.py's cleanup context): connections
  are pooled per upstream and nothing outlives the daemon.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from ...errors import OverloadedError, QueueFullError
from ...protocol.requests import LANE_RANK, LANES
from ...protocol.engine import EngineStats
from .http import UpstreamFailed, get_json
from .state import Upstream

if TYPE_CHECKING:
    from ...config.settings import Settings

log = logging.getLogger(__name__)
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0
LIST_REFRESH_S = 1.0  # an unknown name asks an 'all models' upstream's /models again after this long


Candidate = tuple[Upstream, str]  # an upstream and the model's id there


class RemoteModel(Protocol):
    """What the pool needs of a remote model's engine (engine.py's RemoteEngine, made by
    `remote_engine` there and kept in `UpstreamPool.engines`)."""

    def stats(self) -> EngineStats: ...

    def upstream_names(self) -> list[str]: ...

    def cancel_all(self) -> None: ...


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    model: str = field(compare=False)
    candidates: list[Candidate] = field(compare=False)
    lane: str = field(compare=False)
    future: "asyncio.Future[Candidate]" = field(compare=False)


class UpstreamPool:
    def __init__(self, settings: "Settings"):
        self.settings = settings
        self.upstreams = {u.name: Upstream(u) for u in settings.upstreams}
        self.session: aiohttp.ClientSession | None = None
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self.engines: dict[str, RemoteModel] = {}  # the remote models used so far, by name
        self._health: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # --- lifecycle (the app's cleanup context) ------------------------------------------------
    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.upstream_connect_timeout)
        # trust_env=False: a proxy variable must not reroute requests that carry an upstream's key.
        self.session = aiohttp.ClientSession(timeout=timeout, trust_env=False, auto_decompress=False)
        self._health = asyncio.create_task(self._health_loop(), name="upstream health")

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        for engine in list(self.engines.values()):
            engine.cancel_all()
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(OverloadedError("the server is shutting down"))
        self._waiters.clear()
        if self.session is not None:
            await self.session.close()

    # --- which remote models exist --------------------------------------------------------------
    def candidates(self, model: str) -> list[Candidate]:
        """The upstreams serving `model` (a local alias or a listed id), by config order."""
        out = []
        for up in self.upstreams.values():
            aliases = up.config.aliases()
            if model in aliases:
                out.append((up, aliases[model]))
            elif up.config.exposes_all and model in up.remote_models:
                out.append((up, model))
        return out

    def models(self) -> dict[str, list[str]]:
        """Every remote model name -> the upstreams serving it (what /v1/models and `list` show)."""
        out: dict[str, list[str]] = {}
        for up in self.upstreams.values():
            names = list(up.config.aliases())
            if up.config.exposes_all:
                names += [m for m in up.remote_models if m not in names]
            for name in names:
                out.setdefault(name, []).append(up.name)
        return out

    async def refresh_lists(self) -> None:
        """Fetch /models of every 'all models' upstream whose list is stale (an unknown name may be new)."""
        now = time.monotonic()
        await asyncio.gather(*(self._check(up) for up in self.upstreams.values()
                               if up.config.exposes_all and up.available and now - up.listed_at > LIST_REFRESH_S),
                             return_exceptions=True)

    # --- slots ------------------------------------------------------------------------------------
    def check_queue(self, model: str, lane: str, waiting: dict[str, int]) -> None:
        """QueueFullError (429) past settings.queue_size waiting in this lane for this model."""
        if waiting.get(lane, 0) >= self.settings.queue_size:
            raise QueueFullError(f"the {lane} lane of {model} is full ({self.settings.queue_size} waiting); "
                                 "try again shortly", retry_after=2.0)

    async def acquire(self, model: str, lane: str, exclude: set[str]) -> Candidate:
        """A slot on the best upstream for `model`, waiting in lane order; OverloadedError when no
        upstream of the model is available (all down, or all already tried by this request)."""
        candidates = [c for c in self.candidates(model) if c[0].name not in exclude]
        future: asyncio.Future[Candidate] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(LANE_RANK.get(lane, 1), next(self._seq), model, candidates, lane, future)
        heapq.heappush(self._waiters, waiter)
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.settings.queue_timeout or None)
        except BaseException as e:
            # Leaving (timeout, cancelled): a slot granted in the same instant goes back.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result()[0])
            else:
                future.cancel()
                self._forget(waiter)
            if isinstance(e, asyncio.TimeoutError):
                raise OverloadedError(f"{model} waited {self.settings.queue_timeout:.0f} s for an upstream slot",
                                      retry_after=5.0) from None
            raise

    def _forget(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            heapq.heapify(self._waiters)

    def release(self, upstream: Upstream) -> None:
        upstream.outstanding -= 1
        self._dispatch()

    def waiting(self, model: str) -> dict[str, int]:
        counts = {lane: 0 for lane in LANES}
        for w in self._waiters:
            if w.model == model and not w.future.done():
                counts[w.lane] += 1
        return counts

    def _dispatch(self) -> None:
        """Give free slots to waiters, best lane first; fail waiters no upstream can serve."""
        kept = []
        while self._waiters:
            waiter = heapq.heappop(self._waiters)
            if waiter.future.done():
                continue
            live = [c for c in waiter.candidates if c[0].available]
            if not live:
                names = ", ".join(c[0].name for c in waiter.candidates) or "none left to try"
                waiter.future.set_exception(OverloadedError(
                    f"no upstream is available for this model (upstreams: {names})", retry_after=self._retry_after()))
                continue
            free = [c for c in live if c[0].outstanding < c[0].config.max_concurrency]
            if not free:
                kept.append(waiter)
                continue
            best = min(free, key=lambda c: (c[0].outstanding / c[0].config.max_concurrency, c[0].outstanding))
            best[0].outstanding += 1
            waiter.future.set_result(best)
        for waiter in kept:
            heapq.heappush(self._waiters, waiter)

    def _retry_after(self) -> float:
        now = time.monotonic()
        waits = [u.retry_at - now for u in self.upstreams.values() if u.state == "down"]
        return max(1.0, min(waits, default=1.0))

    # --- health -------------------------------------------------------------------------------------
    def mark_failed(self, upstream: Upstream, reason: str) -> None:
        """Take an upstream out; it is probed again after a doubling backoff."""
        upstream.failures += 1
        upstream.errors += 1
        upstream.last_error = reason
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (upstream.failures - 1))
        if upstream.state != "down":
            log.warning("upstream %s taken out: %s (retry in %.0f s)", upstream.name, reason, backoff)
        upstream.state = "down"
        upstream.retry_at = time.monotonic() + backoff
        self._wake.set()
        self._dispatch()

    def mark_ok(self, upstream: Upstream) -> None:
        if upstream.state != "up":
            log.info("upstream %s is up", upstream.name)
        upstream.state, upstream.failures = "up", 0
        self._dispatch()

    async def _check(self, upstream: Upstream) -> None:
        try:
            data = await get_json(self, upstream, "/models")
        except UpstreamFailed as e:
            self.mark_failed(upstream, e.reason)
            return
        ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)] if isinstance(data, dict) else []
        upstream.remote_models = tuple(i for i in ids if isinstance(i, str) and 0 < len(i) <= 512)
        upstream.listed_at = time.monotonic()
        self.mark_ok(upstream)

    async def _health_loop(self) -> None:
        interval = max(0.5, self.settings.upstream_health_interval)
        next_check = {name: 0.0 for name in self.upstreams}
        while True:
            self._wake.clear()
            now = time.monotonic()
            due = []
            for up in self.upstreams.values():
                when = up.retry_at if up.state == "down" else next_check[up.name]
                if now >= when:
                    due.append(up)
                    next_check[up.name] = now + interval
            if due:
                await asyncio.gather(*(self._check(up) for up in due), return_exceptions=True)
            now = time.monotonic()
            soonest = min((u.retry_at if u.state == "down" else next_check[u.name] for u in self.upstreams.values()),
                          default=now + interval)
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.1, soonest - now))
            except asyncio.TimeoutError:
                pass

    def status(self) -> list[dict[str, Any]]:
        return [u.row() for u in self.upstreams.values()]

    def model_rows(self) -> list[dict[str, Any]]:
        """ModelManager.status() rows of the remote models used so far (/api/ps, ps, /metrics)."""
        rows = []
        for name, engine in sorted(self.engines.items()):
            stats = engine.stats().to_dict()
            rows.append({"name": name, "state": "remote", "remote": True, "upstreams": engine.upstream_names(),
                         "memory_bytes": 0, "memory_held_bytes": 0, "memory_max_bytes": 0,
                         "vram_bytes": 0, "device": "remote", "pinned": 0,
                         "running": stats["running"], "waiting": stats["waiting"], "context_length": 0,
                         "max_sequences": 0, "expires_at": None, "keep_alive": -1, "stats": stats})
        return rows

