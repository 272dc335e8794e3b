"""Newline-delimited JSON responses (Ollama's streams, /api/pull's progress): one object a line."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..api.errors import json_dumps


NDJSON = "application/x-ndjson"


async def open_ndjson(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_line(response: web.StreamResponse, data: Any) -> None:
    await response.write((json_dumps(data) + "\n").encode("utf-8"))
