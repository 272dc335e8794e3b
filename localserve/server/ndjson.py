"""Newline-delimited JSON responses (Ollama's streams, /api/pull's progress): one object a line."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..api.errors import json_dumps
from .held import HeldStream, Keepalive

NDJSON = "application/x-ndjson"
_HEADERS = {"Content-Type": NDJSON, "Cache-Control": "no-cache"}


async def open_ndjson(request: web.Request) -> web.StreamResponse:
    """A plain NDJSON response, its 200 sent now (/api/pull's progress)."""
    response = web.StreamResponse(headers=_HEADERS)
    await response.prepare(request)
    return response


def held_ndjson(request: web.Request, keepalive: Keepalive) -> HeldStream:
    """A generation's NDJSON stream: its 200 held for its first line, `keepalive` after silences."""
    return HeldStream(request, _HEADERS, keepalive)


def line_bytes(data: Any) -> bytes:
    return (json_dumps(data) + "\n").encode("utf-8")


async def send_line(response: web.StreamResponse | HeldStream, data: Any) -> None:
    await response.write(line_bytes(data))
