"""A streamed answer after its 200: the one way every dialect's stream runs and ends.

Once the headers are out no status can change, so the error middleware can no longer answer: a
failure must become a frame of the dialect's own stream (an OpenAI chunk with an "error" member,
Anthropic's `error` event, an Ollama NDJSON `{"error": ...}` line, a Responses `response.failed`),
which the dialect's route passes in as `send_error`. A client that left ends the body quietly; the
caller's context cancels its engine streams.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Awaitable, Callable

from aiohttp import web

from ..api.errors import ClientGone
from ..errors import InternalError, LocalserveError
from .disconnect import guard_disconnect
from .slots import SlotClaim

log = logging.getLogger("localserve.server")

SendError = Callable[[LocalserveError], Awaitable[None]]


async def stream_after_200(request: web.Request, body: Awaitable[None], send_error: SendError, what: str,
                           claim: SlotClaim | None = None) -> None:
    """Run `body` (which writes the stream) under the disconnect guard; our errors become
    `send_error(exc)`, anything else is logged with its traceback and sent as InternalError."""
    try:
        await guard_disconnect(request, body, claim)
    except (ClientGone, ConnectionResetError):
        pass
    except LocalserveError as e:
        with contextlib.suppress(ConnectionResetError):
            await send_error(e)
    except Exception:  # noqa: BLE001 - headers are out: the error middleware can no longer answer
        log.exception("stream of %s failed", what)
        with contextlib.suppress(ConnectionResetError):
            await send_error(InternalError())
