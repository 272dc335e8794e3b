"""A streamed answer: the one way every dialect's stream runs and ends.

The stream is a HeldStream (server/held.py): nothing is sent until its first frame worth sending
or its first keepalive. A failure before that leaves here as the exception it is, and the error
middleware answers with the dialect's HTTP status and body, as for any request: a queue timeout,
a busy engine or a crashed one before any token reaches every client as an error it reads.

Once the 200 is out no status can change, so a failure must become frames of the dialect's own
stream, which the dialect's route passes in as `send_error`: the error frame (an OpenAI chunk
with an "error" member, Anthropic's `error` event, an Ollama `{"error": ...}` line, Responses'
`error` and `response.failed`) and, where the dialect's clients wait for one, the end they read
(OpenAI: a final chunk per open choice with finish_reason "error", then `[DONE]`; Ollama: a
`done` line with done_reason "error"). A client that left ends the body quietly; the caller's
context cancels its engine streams.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Awaitable, Callable

from aiohttp import web

from ..api.errors import ClientGone
from ..errors import InternalError, LocalserveError
from .disconnect import guard_disconnect
from .held import HeldStream
from .slots import SlotClaim

log = logging.getLogger("localserve.server")

SendError = Callable[[LocalserveError], Awaitable[None]]


async def run_stream(out: HeldStream, body: Awaitable[None], send_error: SendError, what: str,
                     claim: SlotClaim | None = None) -> web.StreamResponse:
    """Run `body` (which writes `out`) under the disconnect guard and return the response. A
    failure before the 200 is raised (the error middleware answers it); after it, our errors
    become `send_error(exc)`, anything else is logged with its traceback and sent as InternalError."""
    try:
        await guard_disconnect(out.request, body, claim)
    except (ClientGone, ConnectionResetError):
        pass
    except LocalserveError as e:
        await out.stop_keepalive()
        if not out.committed:
            raise
        with contextlib.suppress(ConnectionResetError):
            await send_error(e)
    except Exception:  # noqa: BLE001 - headers are out: the error middleware can no longer answer
        await out.stop_keepalive()
        if not out.committed:
            raise
        log.exception("stream of %s failed", what)
        with contextlib.suppress(ConnectionResetError):
            await send_error(InternalError())
    return out.response
