"""Server-sent event responses: `data: JSON` frames (OpenAI's streams, llama.cpp's /infill and
/completion), or named events (`event: NAME` then its data: Anthropic's Messages stream).

A stream that has sent nothing for `sse_ping_interval` seconds gets a ping: by default a comment
line (`: ping`), which every SSE parser skips (the OpenAI SDK, EventSource, the plugins' own
readers); a dialect with a ping event of its own (Anthropic's `ping`) passes that frame instead.
A client's read timeout then measures a dead server, not a long prefill or a queue wait. The
pinger lives as long as the handler: `sse_pinger_middleware` stops it when the handler returns or
raises, before aiohttp closes the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..api.errors import json_dumps
from .state import SETTINGS_KEY

PING_COMMENT = b": ping\n\n"
_PINGER = web.RequestKey("sse_pinger", asyncio.Task)  # the handler's ping task
_LAST_WRITE = web.ResponseKey("sse_last_write", float)  # monotonic time of the last frame


async def open_sse(request: web.Request, ping: bytes = PING_COMMENT) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    response[_LAST_WRITE] = time.monotonic()
    interval = request.app[SETTINGS_KEY].sse_ping_interval
    if interval > 0:
        request[_PINGER] = asyncio.create_task(_ping(response, interval, ping))
    return response


async def send_sse(response: web.StreamResponse, data: Any) -> None:
    await _write(response, f"data: {json_dumps(data)}\n\n".encode("utf-8"))


async def send_event(response: web.StreamResponse, event: str, data: Any) -> None:
    """A named event (`event: NAME` before its data), as Anthropic's streams are framed."""
    await _write(response, event_frame(event, data))


def event_frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json_dumps(data)}\n\n".encode("utf-8")


async def _write(response: web.StreamResponse, frame: bytes) -> None:
    await response.write(frame)
    response[_LAST_WRITE] = time.monotonic()


async def _ping(response: web.StreamResponse, interval: float, ping: bytes) -> None:
    while True:
        idle = time.monotonic() - response[_LAST_WRITE]
        if idle < interval:
            await asyncio.sleep(interval - idle)
            continue
        try:
            await _write(response, ping)
        except (ConnectionResetError, RuntimeError):  # the client left, or the response is closed
            return


@web.middleware
async def sse_pinger_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    finally:
        pinger = request.get(_PINGER)
        if pinger is not None:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger
