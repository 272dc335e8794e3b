"""Watching the client while a generation runs: a client that left, or stopped reading, cancels it.

aiohttp (3.9+) does not cancel a handler when its client goes away unless the runner was built with
handler_cancellation=True; a write to the gone client raises ConnectionResetError, but during a long
prefill nothing is written. So every generation runs under `guard_disconnect`, which polls the
transport and cancels the work within DISCONNECT_POLL_S. A client that stays connected but stops
reading is dropped the same way once writing to it has been blocked for
settings.stream_write_timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Awaitable, TypeVar

from aiohttp import web

from ..api.errors import ClientGone
from ..errors import RequestSupersededError
from .slots import SlotClaim
from .state import SETTINGS_KEY

log = logging.getLogger("localserve.server")


DISCONNECT_POLL_S = 0.1


# Bytes a guarded connection may hold unsent, in the kernel and in the transport each. Linux
# autotunes a socket's send buffer up to tcp_wmem's 4 MiB: a client that stops reading would
# absorb ~8,000 stream events there before any write blocked, so the write timeout would never
# fire and its sequence would decode to max_tokens. Token streams need a few KB/s; this is ample.
SEND_BUFFER_BYTES = 16 * 1024


T = TypeVar("T")


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _writes_blocked(request: web.Request) -> bool:
    """True while the transport's buffer is over its high-water mark: the client is not reading
    what we already sent (aiohttp's write() is then waiting for a drain that never comes)."""
    protocol = request.protocol
    return bool(protocol is not None and getattr(protocol, "writing_paused", False))


def _bound_send_buffers(request: web.Request) -> None:
    """Make a client that stops reading block our writes after SEND_BUFFER_BYTES, not megabytes."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:  # not a TCP socket (a test transport): the timeout still works, later
            pass
    transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)


async def guard_disconnect(request: web.Request, work: Awaitable[T], claim: SlotClaim | None = None) -> T:
    """Run `work`; cancel it if the client disconnects first, or stops reading for
    settings.stream_write_timeout seconds (then the connection is dropped), and raise ClientGone;
    or, with the `id_slot` claim it holds, once a newer request supersedes it (then raise
    RequestSupersededError, at once: the newer request waits for this one to let go)."""
    _bound_send_buffers(request)
    task = asyncio.ensure_future(work)
    superseded = asyncio.ensure_future(claim.superseded.wait()) if claim is not None else None
    write_timeout = request.app[SETTINGS_KEY].stream_write_timeout
    blocked_since: float | None = None
    try:
        while True:
            done, _ = await asyncio.wait({task, superseded} - {None}, timeout=DISCONNECT_POLL_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if superseded in done:
                raise RequestSupersededError(claim.slot)  # the finally ends the work
            gone = _client_gone(request)
            if not gone and _writes_blocked(request):
                now = time.monotonic()
                blocked_since = blocked_since if blocked_since is not None else now
                if write_timeout and now - blocked_since >= write_timeout:
                    log.info("%s: the client read nothing for %.0f s; dropping it", request.path, write_timeout)
                    # abort, not close: close() would wait to flush a buffer nobody reads, and
                    # the pending write (and aiohttp's final write_eof) would wait with it.
                    if request.transport is not None:
                        request.transport.abort()
                    gone = True
            else:
                blocked_since = None
            if gone:
                raise ClientGone()  # the finally ends the work
    finally:
        if superseded is not None:
            superseded.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
