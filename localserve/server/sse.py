"""Server-sent event streams: `data: JSON` frames (OpenAI's streams, llama.cpp's /infill and
/completion), or named events (`event: NAME` then its data: Anthropic's Messages stream, Responses).

A stream is a HeldStream (server/held.py): its 200 waits for the first frame worth sending, and
after `sse_ping_interval` seconds of silence it gets the keepalive its dialect's route names: a
frame the client's SDK reads as progress (an empty-delta chunk, Anthropic's `ping`, Responses'
`response.in_progress`), or by default a comment line (`: ping`, as llama-server sends for
llama.cpp's own routes), which every SSE parser skips.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..api.errors import json_dumps
from .held import HeldStream, Keepalive

PING_COMMENT = b": ping\n\n"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def open_sse(request: web.Request, keepalive: Keepalive = lambda: PING_COMMENT) -> HeldStream:
    return HeldStream(request, SSE_HEADERS, keepalive)


def data_frame(data: Any) -> bytes:
    return f"data: {json_dumps(data)}\n\n".encode("utf-8")


def event_frame(event: str, data: Any) -> bytes:
    """A named event (`event: NAME` before its data), as Anthropic's and Responses' streams are framed."""
    return f"event: {event}\ndata: {json_dumps(data)}\n\n".encode("utf-8")


async def send_sse(out: HeldStream, data: Any) -> None:
    await out.write(data_frame(data))


async def send_event(out: HeldStream, event: str, data: Any) -> None:
    await out.write(event_frame(event, data))
