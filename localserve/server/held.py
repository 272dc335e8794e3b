"""A streamed answer whose 200 waits until there is something to send, and whose silences are kept alive.

Two things commit the status line, and nothing else does:
- the first frame that carries the answer (a token's text, a final chunk). The frames a dialect
  opens with (OpenAI's role chunk, Anthropic's `message_start`, Responses' `response.created`)
  are held until then, so a failure before the first token (a queue timeout, a crashed engine, a
  bad grammar) is still the dialect's own HTTP error status, which every client reads: a queue
  timeout written as `data: {"error": ...}` after the role chunk was shown as text by Kilo and
  read as "stream ended without a finish reason" by Mistral Vibe (issue 47).
- a keepalive, after `sse_ping_interval` seconds of silence (a long CPU prefill, a queue wait,
  tool-call text held back). It is a frame the client's SDK parses as progress, not an SSE
  comment: the SDKs drop comments, so the clients' own idle guards above them saw nothing (Qwen
  Code's 240 s guard fired and retried, Cline's Ollama provider gave up at 300 s). The keepalive
  is also why a failure can still come after the 200: Cline wants a first byte within 30 s, so a
  request that waits longer (the 600 s queue timeout) has had its 200 by the time it fails, and
  ends with its dialect's error frame (server/streamed.py).

The keepalive task lives as long as the handler: `keepalive_middleware` stops it when the handler
returns or raises, before aiohttp closes the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable

from aiohttp import web

from .state import SETTINGS_KEY

Keepalive = Callable[[], bytes]  # the frame sent after a silence, made when it is sent
_KEEPALIVE = web.RequestKey("stream_keepalive", asyncio.Task)  # the handler's keepalive task


class HeldStream:
    """The body of one streamed answer: `hold` the opening frames, `write` the rest."""

    def __init__(self, request: web.Request, headers: dict[str, str], keepalive: Keepalive):
        self.request = request
        self.response = web.StreamResponse(headers=headers)
        self._keepalive = keepalive
        self._held: list[bytes] = []
        self._last_write = time.monotonic()
        self._commit_lock = asyncio.Lock()
        interval = request.app[SETTINGS_KEY].sse_ping_interval
        if interval > 0:
            request[_KEEPALIVE] = asyncio.create_task(self._keep_alive(interval))

    @property
    def committed(self) -> bool:
        """True once the status line is out: from then on a failure is a frame of the stream."""
        return self.response.prepared

    async def hold(self, frame: bytes) -> None:
        """An opening frame: sent just before the first frame written (or keepalive), not now."""
        if self.committed:
            await self.write(frame)
        else:
            self._held.append(frame)

    async def write(self, frame: bytes) -> None:
        if not self.committed:
            await self._commit()
        await self.response.write(frame)
        self._last_write = time.monotonic()

    async def _commit(self) -> None:
        async with self._commit_lock:  # the body and the keepalive may both get here first
            if self.committed:
                return
            await self.response.prepare(self.request)
            held, self._held = b"".join(self._held), []
            if held:
                await self.response.write(held)

    async def stop_keepalive(self) -> None:
        """No keepalive from now on: after this, only the caller's own writes can commit the stream."""
        await _stop_keepalive(self.request)

    async def _keep_alive(self, interval: float) -> None:
        while True:
            idle = time.monotonic() - self._last_write
            if idle < interval:
                await asyncio.sleep(interval - idle)
                continue
            try:
                await self.write(self._keepalive())
            except (ConnectionResetError, RuntimeError):  # the client left, or the response is closed
                return


@web.middleware
async def keepalive_middleware(request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    finally:
        await _stop_keepalive(request)


async def _stop_keepalive(request: web.Request) -> None:
    task = request.get(_KEEPALIVE)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
