"""Prometheus over HTTP: the middleware that counts every answer, and GET /metrics (the figures
themselves are api/metrics.py's)."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ..api.live import ORIGIN, origin_for
from ..api.metrics import Metrics
from .errors import Handler
from .state import METRICS_KEY


def metrics_middleware(metrics: Metrics):
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        start = time.perf_counter()
        metrics.in_flight.inc()
        status = 500
        # Who asked, for the dashboard: generation() lists the streams under it, the latency rings
        # time TTFT from here, and the request counts once per dialect and route when answered.
        origin = origin_for(route, metrics.live)
        token = ORIGIN.set(origin)
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            ORIGIN.reset(token)
            if origin is not None:
                metrics.live.count(origin)
            metrics.in_flight.dec()
            metrics.requests.labels(route, str(status)).inc()
            metrics.duration.labels(route).observe(time.perf_counter() - start)

    return middleware


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
