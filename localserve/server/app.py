"""The aiohttp application: routes, middlewares and state, built by `create_app(settings, manager)`.

Middleware order (outermost first): security (Host check, CORS preflight, API key) answers before
anything is parsed; metrics counts every answer with its final status; errors turns exceptions
into JSON bodies in the caller's dialect; body limits refuse a declared oversize body (413)
before any handler reads it; innermost, a streaming handler's keepalive (held.py) stops with it. CORS headers are added in on_response_prepare so that
streaming responses, whose headers leave before the handler returns, get them too.

The app owns the manager it is given: on cleanup (server shutdown) the manager is closed, which
cancels in-flight requests and unloads every model.
"""

from __future__ import annotations

import ipaddress
import time
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import web

from .. import __version__
from ..config.settings import Settings
from ..errors import ConfigError
from ..store.cache import ModelStore
from . import (anthropic_routes, batch_routes, dashboard_routes, llamacpp_routes, ollama_routes, openai_routes, pull_routes,
               rerank_routes, responses_routes)
from .body import body_limits_middleware
from .errors import error_middleware
from ..api.dashboard_feed import DashboardFeed
from .metrics import handle_metrics, metrics_middleware
from ..api.metrics import Metrics, UpstreamCollector
from .security import WILDCARD_HOSTS, add_cors_headers, security_middleware
from .held import keepalive_middleware
from .slots import SlotClaims
from .state import FEED_KEY, MANAGER_KEY, METRICS_KEY, SETTINGS_KEY, SLOTS_KEY, STARTED_KEY, STORE_KEY

if TYPE_CHECKING:
    from ..runtime.manager import ModelManager


def is_loopback_bind(host: str) -> bool:
    if host == "localhost":
        return True
    if host in WILDCARD_HOSTS:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def health(request: web.Request) -> web.Response:
    # Answers from memory only: no engine or manager call that could wait behind a busy model,
    # so a service manager's probe stays fast while every lane is full.
    return web.json_response({
        "status": "ok",
        "version": __version__,
        "uptime_s": round(time.time() - request.app[STARTED_KEY], 3),
    })


def create_app(settings: Settings, manager: "ModelManager") -> web.Application:
    """The HTTP API over `manager` (a ModelManager); the app closes the manager on cleanup."""
    if not is_loopback_bind(settings.host) and not settings.api_key:
        # Anyone on the network could use the models (and pull or delete them) otherwise.
        raise ConfigError(f"binding {settings.host} (not loopback) requires an API key (set api_key)")
    metrics = Metrics(manager.status)
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[security_middleware(settings), metrics_middleware(metrics), error_middleware, body_limits_middleware,
                     keepalive_middleware],
    )
    app[SETTINGS_KEY] = settings
    app[MANAGER_KEY] = manager
    app[STORE_KEY] = ModelStore(settings)
    app[METRICS_KEY] = metrics
    app[STARTED_KEY] = time.time()
    app[FEED_KEY] = DashboardFeed(manager, metrics)  # the dashboard's one snapshot a second
    app[SLOTS_KEY] = SlotClaims()
    app.on_response_prepare.append(add_cors_headers)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", handle_metrics)
    app.add_routes(openai_routes.routes)
    app.add_routes(responses_routes.routes)  # /v1/responses (api/responses.py)
    app.add_routes(rerank_routes.routes)  # /v1/rerank and its other paths (api/rerank.py)
    app.add_routes(ollama_routes.routes)
    app.add_routes(llamacpp_routes.routes)  # /infill
    app.add_routes(anthropic_routes.routes)  # /v1/messages, /v1/messages/count_tokens
    app.add_routes(pull_routes.routes)
    app.add_routes(dashboard_routes.routes)  # `/` (page or plain text), its files, live stats
    app.add_routes(batch_routes.routes)  # /v1/files, /v1/batches
    app.cleanup_ctx.append(pull_routes.pull_slots)
    app.cleanup_ctx.append(_manager_lifecycle)
    if manager.upstreams is not None:
        metrics.registry.register(UpstreamCollector(manager.upstreams.status))
        app.cleanup_ctx.append(_upstreams_lifecycle)
    # Last: cleanup runs in reverse, so the runner stops (its pinned models released) first.
    app.cleanup_ctx.append(batch_routes.batch_runner)
    return app


async def _upstreams_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The upstreams' HTTP session and health checks live exactly as long as the app."""
    pool = app[MANAGER_KEY].upstreams
    assert pool is not None
    await pool.start()
    yield
    await pool.close()


async def _manager_lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[MANAGER_KEY].close()
