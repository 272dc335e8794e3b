"""Ollama's `/api/pull`, isolated from the rest of the API.

A pull is slow, blocking work (network, disk, hashing) that a client can start at will. So pulls:
- run on a thread pool of their own (`PullSlots`, made and shut down with the app), never on
  asyncio's default executor, which model lookups, listings and loads use: six pulls of links
  that trickle bytes must not make `/v1/models` or a chat wait;
- are capped at `max_concurrent_pulls`; beyond that the answer is 429 with Retry-After at once
  (a queue would only hide the wait);
- stop when their client goes away (CancelToken: the download ends at once, its partial stays);
- of a link the client chose, must pass the UrlPolicy (https to a public address, unless the host
  is in `pull_allow_http_hosts`), checked before anything is sent.

Once the NDJSON stream has started, a failure is its last line (`{"error": ...}`): a second
response into a started stream is impossible.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from ..config.settings import Settings
from ..errors import LocalserveError, QueueFullError
from ..pull import pull_model
from ..pull.cancel import CancelToken
from ..protocol.progress import PullEvent
from ..pull.policy import UrlPolicy, is_direct_link
from ..api.errors import ClientGone
from .disconnect import guard_disconnect
from .ndjson import open_ndjson, send_line
from ..api.ollama import model_name
from .state import SETTINGS_KEY
from .body import read_json

log = logging.getLogger("localserve.server")
routes = web.RouteTableDef()

RETRY_AFTER_S = 10.0  # a pull takes minutes; asking again within seconds would only be refused again
MAX_QUEUED_EVENTS = 256  # byte counts beyond this are dropped (the next one carries a newer count)


class PullSlots:
    """The daemon's pull capacity: a thread pool sized to the cap, and the pulls running on it. A
    slot is freed when the pull's thread ends, not when its request does: a cancelled pull may take
    a moment to wind down, and a new pull must not queue behind it."""

    def __init__(self, size: int):
        self.size = max(1, size)
        self.executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="localserve-pull")
        self._lock = threading.Lock()
        self._running: set[CancelToken] = set()

    @property
    def active(self) -> int:
        """Pulls running now (the dashboard and the tray show it)."""
        return len(self._running)

    def start(self, work: Callable[[], Any], cancel: CancelToken) -> "asyncio.Future[Any]":
        with self._lock:
            if len(self._running) >= self.size:
                raise QueueFullError(
                    f"{self.size} pulls are already running (max_concurrent_pulls); try again later", RETRY_AFTER_S)
            self._running.add(cancel)
        try:
            future: Future[Any] = self.executor.submit(work)
        except RuntimeError:  # the pool shut down: the daemon is stopping
            self._release(cancel)
            raise QueueFullError("the server is shutting down", RETRY_AFTER_S) from None
        future.add_done_callback(lambda _: self._release(cancel))
        return asyncio.wrap_future(future)

    def _release(self, cancel: CancelToken) -> None:
        with self._lock:
            self._running.discard(cancel)

    def close(self) -> None:
        with self._lock:
            running = list(self._running)
        for cancel in running:
            cancel.cancel()
        # Cancelled downloads end within moments; do not block the loop on one that is hashing.
        self.executor.shutdown(wait=False, cancel_futures=True)


PULLS_KEY = web.AppKey("pulls", PullSlots)


async def pull_slots(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the pull pool lives exactly as long as the app."""
    slots = PullSlots(app[SETTINGS_KEY].max_concurrent_pulls)
    app[PULLS_KEY] = slots
    yield
    slots.close()


class _Relay:
    """Carries progress events from the pull thread onto the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: CancelToken):
        self.loop, self.cancel = loop, cancel
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def progress(self, event: PullEvent) -> None:
        self.cancel.check()  # also stops hashing and unpacking, which have no socket to shut
        if event.completed is not None and self.events.qsize() > MAX_QUEUED_EVENTS:
            return  # a client that reads slowly: skip byte counts rather than buffer without bound
        self.loop.call_soon_threadsafe(self.events.put_nowait, event.to_dict())

    async def next(self, job: "asyncio.Future[Any]") -> dict[str, Any] | None:
        """The next event, or None once the pull ended and every event was taken."""
        getter = asyncio.ensure_future(self.events.get())
        try:
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        return None if self.events.empty() else self.events.get_nowait()


def _line(item: dict[str, Any]) -> dict[str, Any]:
    line = {"status": item.get("status", "")}
    if item.get("part") is not None:
        line["digest"] = item["part"]
    for key in ("total", "completed"):
        if item.get(key) is not None:
            line[key] = item[key]
    return line


def _error_text(error: BaseException) -> str:
    if isinstance(error, LocalserveError) and error.http_status != 500:
        return error.message
    log.error("pull failed", exc_info=error)
    return "internal server error"


async def _stream(request: web.Request, job: "asyncio.Future[Any]", relay: _Relay) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    last = None
    try:
        while (item := await guard_disconnect(request, relay.next(job))) is not None:
            if response is None:  # first event: the name resolved, so errors from here on go in-stream
                response = await open_ndjson(request)
            line = _line(item)
            await send_line(response, line)
            last = line["status"]
        job.result()
        if response is None:
            response = await open_ndjson(request)
        if last != "success":
            await send_line(response, {"status": "success"})
        return response
    except (ClientGone, ConnectionError):
        if response is None:
            raise ClientGone() from None
        return response  # the client left mid-stream: nothing more can be sent
    except Exception as e:  # noqa: BLE001 - after the first byte, every failure is the stream's last line
        if response is None:
            raise
        try:
            await send_line(response, {"error": _error_text(e)})
        except ConnectionError:
            pass
        return response


def _start(request: web.Request, settings: Settings, ref: str, relay: _Relay, cancel: CancelToken,
           policy: UrlPolicy | None) -> "asyncio.Future[Any]":
    work = functools.partial(pull_model, ref, settings, relay.progress, cancel=cancel, policy=policy)
    return request.app[PULLS_KEY].start(work, cancel)


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    ref = model_name(body)
    stream = body.get_bool("stream", True)
    settings = request.app[SETTINGS_KEY]
    policy = None
    if is_direct_link(ref):
        policy = UrlPolicy.from_settings(settings)
        policy.check_url(ref.strip())  # 400 before any connection is made
    cancel = CancelToken()
    relay = _Relay(asyncio.get_running_loop(), cancel)
    job = _start(request, settings, ref, relay, cancel, policy)  # 429 when every slot is taken
    try:
        if not stream:
            await guard_disconnect(request, asyncio.shield(job))
            return web.json_response({"status": "success"})
        return await _stream(request, job, relay)
    finally:
        # Ended, failed or abandoned: a pull still running has lost its client, so stop it (the
        # partial stays for a resume). After a finished pull this does nothing.
        cancel.cancel()
        job.add_done_callback(_ignore_result)


def _ignore_result(job: "asyncio.Future[Any]") -> None:
    if not job.cancelled():
        error = job.exception()
        if error is not None and not isinstance(error, LocalserveError):  # ours were answered or are moot
            log.error("pull failed after its client left", exc_info=error)
