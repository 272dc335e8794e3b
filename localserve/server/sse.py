"""Server-sent event responses (OpenAI's streams, llama.cpp's /infill): `data: JSON` frames; Anthropic's
name each event."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..api.errors import json_dumps


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, data: Any) -> None:
    await response.write(f"data: {json_dumps(data)}\n\n".encode("utf-8"))


async def send_event(response: web.StreamResponse, event: str, data: Any) -> None:
    """A named event (`event: NAME` before its data), as Anthropic's streams are framed."""
    await response.write(f"event: {event}\ndata: {json_dumps(data)}\n\n".encode("utf-8"))
