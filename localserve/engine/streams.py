"""A request's stream of events on the asyncio side, and the one way engines hand events to it.

`EventQueue` is what every stream a caller iterates shares: the engine (or a worker's reader
thread) delivers with `post_events`, one `call_soon_threadsafe` per loop per step, and the reader
awaits `__anext__`. `RequestStream` is our engine's (engine/local.py, engine/oga/), whose cancel
flags its sequence; the engine worker's proxy has its own (engine/worker/proxy.py), whose cancel is
a message to the worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from ..protocol.requests import GenerationEvent

if TYPE_CHECKING:
    from ..batching.sequence import Sequence

log = logging.getLogger(__name__)

# Events a stream may hold unread before the engine stops its sequence. A reading client takes
# each step's event within milliseconds; one that stops reading (while the server's socket buffers
# fill up) would otherwise keep its sequence decoding into an unbounded queue. 1024 steps are tens
# of seconds of a fast model's output: far beyond any reader that is merely slow.
STREAM_BUFFER_EVENTS = 1024


class EventQueue:
    """Async iterator of one request's GenerationEvents; the last one carries finish_reason.
    Subclasses say which request it is and how to cancel it."""

    loop: asyncio.AbstractEventLoop

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._done = False
        self.overflowed = False  # cancelled because its reader fell buffer_events behind

    @property
    def request_id(self) -> str:
        raise NotImplementedError

    @property
    def buffer_events(self) -> int:
        return STREAM_BUFFER_EVENTS

    def cancel(self) -> None:
        raise NotImplementedError

    def _put(self, event: GenerationEvent) -> None:
        # Events are never dropped (the stream's text must stay whole); a reader this far behind
        # has its request cancelled instead, and the "cancelled" finish still arrives.
        self._queue.put_nowait(event)
        if event.finish_reason is None and self._queue.qsize() > self.buffer_events and not self.overflowed:
            log.info("request %s: %d events unread, cancelling it", self.request_id, self._queue.qsize())
            self.overflowed = True
            self.cancel()

    def __aiter__(self) -> "EventQueue":
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.finish_reason is not None:
            self._done = True
        return event


class RequestStream(EventQueue):
    """The stream of a request in our engine: cancelling flags its sequence and wakes the engine's
    thread (`wake`), which ends it at its next step."""

    def __init__(self, seq: "Sequence", loop: asyncio.AbstractEventLoop, wake: Callable[[], None],
                 buffer_events: int = STREAM_BUFFER_EVENTS):
        super().__init__(loop)
        self._seq = seq
        self._wake = wake
        self._buffer_events = buffer_events

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def buffer_events(self) -> int:
        return self._buffer_events

    def cancel(self) -> None:
        """Safe from any thread or coroutine; the stream ends with finish_reason "cancelled"
        (unless it already finished) after the engine's next step."""
        self._seq.cancelled = True
        self._wake()


def post_events(items: list[tuple[EventQueue, GenerationEvent]]) -> None:
    """Hand events to the loops that own their streams, from any thread: one wakeup per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, event in items:
        by_loop.setdefault(stream.loop, []).append((stream, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that loop is closed: its client is gone
            pass


def _put_all(items: list[tuple[EventQueue, GenerationEvent]]) -> None:
    for stream, event in items:
        stream._put(event)
