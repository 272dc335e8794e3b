"""The web dashboard: its static page at `/`, and the live stats it draws.

- `GET /`: the dashboard for browsers (Accept prefers text/html); the old plain-text "localserve is
  running" for everything else, since Ollama clients probe `/` to see whether a server is up.
- `GET /dashboard/{file}`: the page's own files, from the package (a fixed list: no path from the
  request ever reaches the filesystem).
- `GET /api/dashboard/state[?model=NAME]`: one snapshot, made now (the tray polls it);
  `GET /api/dashboard/stats[?model=NAME]`: the shared snapshot as server-sent events, once a second.
  A model that is not installed is a 404.
- `POST /api/dashboard/requests/{id}/cancel`: end that request's stream (the page's row button).
- `GET /api/dashboard/hardware`: what `localserve hw` reports and where each installed model runs.

Snapshots come from api/dashboard_feed.py: ModelManager.status() (each engine's stats() copy), the
exact latency rings and the requests in flight (api/live.py), read without locks on the event loop
and computed once a second however many pages are open, so a connected dashboard costs the engine
thread nothing. Each stream writes one event and waits for it to drain
before the next, so a client that stops reading holds at most one event; guard_disconnect drops it
after stream_write_timeout.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

from aiohttp import web

from ..errors import NotFoundError
from .disconnect import guard_disconnect
from ..api.errors import ClientGone
from .pull_routes import PULLS_KEY
from .state import FEED_KEY, METRICS_KEY, SETTINGS_KEY, STORE_KEY

routes = web.RouteTableDef()

STATS_INTERVAL_S = 1.0
# The page's files and their types; anything else under /dashboard/ is a 404.
ASSETS = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "charts.js": "text/javascript",
    "style.css": "text/css",
    "icon.svg": "image/svg+xml",
}
PLAIN_ROOT = "localserve is running"
# Sent with the page and each of its files. "Unload" is one click on the page's own origin, which no
# CSRF check can tell from the user's: another site must not frame the page to steer that click
# (frame-ancestors; X-Frame-Options for browsers without CSP 2). The rest keeps the page to its
# own files, which is all it loads: no inline script or style, no plugins, no foreign requests.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return resources.files("localserve").joinpath("dashboard", name).read_bytes()


def prefers_html(accept: str) -> bool:
    """True when text/html has a higher q than anything else the client lists (browsers send
    text/html first; curl sends */*, Ollama clients nothing)."""
    best_html, best_other = 0.0, 0.0
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        q = 1.0
        for param in fields[1:]:
            if param.lower().startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        if media in ("text/html", "application/xhtml+xml"):
            best_html = max(best_html, q)
        elif media and media != "*/*":
            best_other = max(best_other, q)
    return best_html > 0 and best_html >= best_other


@routes.get("/")
async def root(request: web.Request) -> web.Response:
    if prefers_html(request.headers.get("Accept", "")):
        # The page must know whether to ask for the key before its first call: a 401 would be a
        # console error on every visit.
        required = "1" if request.app[SETTINGS_KEY].api_key else "0"
        page = _asset("index.html").replace(b"{{KEY_REQUIRED}}", required.encode())
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)
    return web.Response(text=PLAIN_ROOT)


@routes.get("/dashboard/{name}")
async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.Response(body=_asset(name), content_type=ASSETS[name], headers=PAGE_HEADERS)


def snapshot(app: web.Application, only: str | None = None, fresh: bool = False) -> dict[str, Any]:
    """The shared snapshot (api/dashboard_feed.py), narrowed to one model when asked; `fresh`: made
    now, for a one-off read."""
    pulls = app[PULLS_KEY].active if PULLS_KEY in app else 0
    snap = app[FEED_KEY].snapshot(pulls, bool(app[SETTINGS_KEY].api_key), STATS_INTERVAL_S, fresh)
    if only is not None:
        snap = {**snap, "models": [m for m in snap["models"] if m["name"] == only]}
    return snap


async def _model_filter(request: web.Request) -> str | None:
    name = request.query.get("model")
    if name is None:
        return None
    # Not installed: NotFoundError -> 404 in the caller's dialect, before any stream starts.
    return (await asyncio.to_thread(request.app[STORE_KEY].find, name)).ref


@routes.get("/api/dashboard/state")
async def state(request: web.Request) -> web.Response:
    # Made now: the tray reads it right after a click (unload) and must see the result.
    return web.json_response(snapshot(request.app, await _model_filter(request), fresh=True))


@routes.get("/api/dashboard/stats")
async def stats(request: web.Request) -> web.StreamResponse:
    only = await _model_filter(request)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def pump() -> None:
        while True:
            data = json.dumps(snapshot(request.app, only), separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode("utf-8"))  # waits for the drain
            await asyncio.sleep(STATS_INTERVAL_S)

    try:
        await guard_disconnect(request, pump())
    except (ClientGone, ConnectionResetError):
        pass
    return response


@routes.post("/api/dashboard/requests/{request_id}/cancel")
async def cancel(request: web.Request) -> web.Response:
    """End one running request's stream, as its client leaving would: the engine drops it at its
    next step and the stream ends in its dialect's way (an OpenAI error frame with code
    request_cancelled, Anthropic's error event, Ollama's error line, a failed batch line)."""
    request_id = request.match_info["request_id"]
    if not request.app[METRICS_KEY].live.cancel(request_id):
        raise NotFoundError(f"no request {request_id[:64]!r} is running")
    return web.json_response({"cancelled": request_id})


@routes.get("/api/dashboard/hardware")
async def hardware(request: web.Request) -> web.Response:
    settings, store = request.app[SETTINGS_KEY], request.app[STORE_KEY]

    def gather() -> dict[str, Any]:
        from ..runtime.describe import describe_model
        from ..errors import LocalserveError
        from ..runtime.planning import hardware_report

        placements = []
        for model in store.list():
            try:
                place = describe_model(model, settings)["placement"]
                placements.append({"name": model.ref, "device": place.get("device"), "reason": place.get("reason")})
            except LocalserveError as e:  # a damaged file: say so for that model, keep the others
                placements.append({"name": model.ref, "device": None, "reason": str(e)})
        return {"hardware": hardware_report().to_dict(), "placements": placements}

    return web.json_response(await asyncio.to_thread(gather))
