"""The engine worker process: loads one model with the daemon's own loader and serves it over a pipe.

It runs the same ModelEngine (engine/local.py, or onnxruntime-genai's) the daemon would run in
process, behind an asyncio loop that turns the daemon's messages (channel.py) into engine calls and
the engine's events back into messages: one "events" message per loop turn carries every stream's
events of a step. Its stderr, where llama.cpp's aborts (GGML_ASSERT) and ONNX Runtime's fatal
messages go, is a log file the daemon reads back when this process dies.

The process ignores SIGINT: Ctrl-C in the terminal running `localserve serve` reaches the whole
process group, and the daemon, not each worker, decides how in-flight work ends. It exits when the
daemon says so or when the pipe closes (the daemon died).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from ...errors import BackendError, LocalserveError
from ...protocol.engine import ModelEngine
from ..streams import RequestStream
from .. import core_share, live, threads
from ..core_share import CoreShare
from .channel import CALLS, Channel
from .rss import rss_bytes

LIVE_VIEWS = {"live_sequences": live.sequences, "live_steps": live.steps_since, "live_parked": live.parked_cells}
BEAT_S = 1.0  # how often a working engine says it moved on (the daemon's hang watchdog reads it)


def main(conn: Connection, load: Callable[..., ModelEngine], args: tuple, log_path: Path | None,
         log_level: int = logging.INFO, share: CoreShare | None = None) -> None:
    """The process's entry: `load(*args)` -> a started ModelEngine, then serve it until told to stop.
    `share`: the daemon's, so this model's steps and other workers' share the cores."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if share is not None:
        core_share.install(share)
    # ggml's abort attaches gdb for a backtrace where gdb is installed: seconds of a dying process,
    # and its last lines in the log are gdb's, not the assert that failed.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    if log_path is not None:
        _stderr_to(log_path)
    channel = Channel(conn)
    _forward_logging(channel, log_level)
    # The interpreter and llama.cpp's code: the load's plan leaves them out, the worker's RSS does
    # not, so the daemon's "at most" adds this.
    before = rss_bytes() or 0
    threads.read_from_now()  # the thread governor's first reading runs while the model loads
    try:
        engine = load(*args)
    except BaseException as e:  # noqa: BLE001 - whatever it was, the daemon answers the load with it
        logging.getLogger(__name__).warning("load failed", exc_info=True)
        channel.send("load_failed", _wire(e))
        return
    channel.send("ready", engine.info, engine.n_ctx_per_seq, _backend_name(engine), os.getpid(), before)
    asyncio.run(Worker(engine, channel).serve())


class Worker:
    def __init__(self, engine: ModelEngine, channel: Channel):
        self.engine = engine
        self.channel = channel
        self.streams: dict[str, Any] = {}
        self.cancelled_early: set[str] = set()  # cancels that overtook their request's acceptance
        self.tasks: dict[int, asyncio.Task] = {}
        self.outbox: list[tuple[str, Any]] = []
        self.working = threading.Event()  # something is in flight: the heartbeat runs
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.send_now = _SendNow(self)

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        done = asyncio.Event()
        threading.Thread(target=self._read, args=(done,), name="worker-reader", daemon=True).start()
        threading.Thread(target=self._beat, name="worker-heartbeat", daemon=True).start()
        await done.wait()

    # --- messages in -----------------------------------------------------------------------
    def _read(self, done: asyncio.Event) -> None:
        assert self.loop is not None
        while True:
            try:
                message = self.channel.conn.recv()
            except (EOFError, OSError):  # the daemon is gone: stop what runs, then exit
                message = ("shutdown", 5.0)
            self.loop.call_soon_threadsafe(self._handle, message, done)
            if message[0] == "shutdown":
                return

    def _handle(self, message: tuple, done: asyncio.Event) -> None:
        kind = message[0]
        if kind == "generate":
            self._spawn(message[1], self._generate(*message[1:]))
        elif kind == "cancel":
            stream = self.streams.get(message[1])
            if stream is not None:
                stream.cancel()
            else:
                self.cancelled_early.add(message[1])
        elif kind in ("embed", "rank"):
            self._spawn(message[1], self._reply(message[1], getattr(self.engine, kind)(*message[2:])))
        elif kind == "abandon":
            task = self.tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "call":
            self._spawn(message[1], self._reply(message[1], self._call(message[2], message[3])))
        elif kind == "shutdown":
            asyncio.ensure_future(self._shutdown(message[1], done))

    def _spawn(self, call: int, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks[call] = task
        self.working.set()
        task.add_done_callback(lambda _, call=call: self._task_done(call))

    def _task_done(self, call: int) -> None:
        self.tasks.pop(call, None)
        self._idle_if_done()

    def _idle_if_done(self) -> None:
        if not self.tasks and not self.streams:
            self.working.clear()

    async def _generate(self, call: int, request: Any) -> None:
        try:
            stream = await self.engine.generate(request)
        except BaseException as e:  # noqa: BLE001 - the refusal is the caller's (400, 429, 503)
            self.channel.send("fail", call, _wire(e))
            return
        rid = stream.request_id
        self.streams[rid] = stream
        direct = isinstance(stream, RequestStream)
        if direct:
            # Our engines' streams (llama.cpp, ONNX, OGA) deliver through post_events, once per
            # step, to `stream.loop`: pointed at _SendNow, the engine thread itself sends the step's
            # events to the daemon between two decodes, instead of waking this loop (and a task per
            # stream) during the next decode, on the cores it needs: at one stream that cost 2.5 ms
            # a token here. Set before anything here lets the GIL go; a first step delivered to
            # this loop in the instant before (the engine thread finishing a decode meanwhile)
            # still reaches the daemon through `_put`, ahead of the next step.
            stream.loop = self.send_now
            stream._put = lambda event, rid=rid: self._forward(rid, event)
        self.channel.send("reply", call, None)
        if rid in self.cancelled_early:
            self.cancelled_early.discard(rid)
            stream.cancel()
        if direct:
            return
        try:
            async for event in stream:
                self._forward(rid, event)
        finally:
            self.streams.pop(rid, None)
            self._idle_if_done()

    def _finished(self, rid: str) -> None:
        if self.streams.pop(rid, None) is not None:
            self._idle_if_done()

    def _forward(self, rid: str, event: Any) -> None:
        self._post(rid, event)
        if event.finish_reason is not None and self.streams.pop(rid, None) is not None:
            self._idle_if_done()

    async def _reply(self, call: int, coro: Any) -> None:
        try:
            value = await coro
        except asyncio.CancelledError:
            return  # abandoned by its caller: nobody reads an answer
        except BaseException as e:  # noqa: BLE001
            self.channel.send("fail", call, _wire(e))
            return
        self.channel.send("reply", call, value)

    async def _call(self, method: str, args: tuple) -> Any:
        if method not in CALLS:
            raise BackendError(f"the engine worker has no call {method!r}")
        # A long text, or an image's preprocessing, must not hold up the streams' events.
        if method in ("tokenize", "detokenize", "token_pieces", "tokenize_media"):
            return await asyncio.to_thread(getattr(self.engine, method), *args)
        if method == "stats":
            return self.engine.stats()
        return LIVE_VIEWS[method](self.engine, *args)

    async def _shutdown(self, timeout: float, done: asyncio.Event) -> None:
        self.stopping = True
        await asyncio.to_thread(self.engine.shutdown, timeout)
        # The streams end "cancelled" with the engine: let their last events out first.
        pending = [t for t in self.tasks.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for _ in range(20):  # the engine's last deliveries are callbacks on this loop
            if not self.streams:
                break
            await asyncio.sleep(0.05)
        self._flush()
        done.set()

    # --- messages out ----------------------------------------------------------------------
    def _post(self, rid: str, event: Any) -> None:
        """Queue an event; a step's events go out together, once every stream's task has run."""
        if not self.outbox:
            assert self.loop is not None
            self.loop.call_soon(self._flush)
        self.outbox.append((rid, event))

    def _flush(self) -> None:
        if self.outbox:
            events, self.outbox = self.outbox, []
            self.channel.send("events", events)

    def _beat(self) -> None:
        """While work is in flight, once a second if the engine moved on since the last beat: a
        step stuck in native code (or a process frozen whole) stops the beats, and the daemon's
        watchdog ends it (proxy.py). Idle, this thread sleeps on an event: no wakeups."""
        last = None
        while True:
            self.working.wait()
            time.sleep(BEAT_S)
            progress = _progress(self.engine)
            longest = _longest_recent_step(self.engine)
            if progress == (None, None) or progress != last:
                last = progress
                if not self.channel.send("beat", progress, longest):
                    return


class _SendNow:
    """Stands in for the event loop of the streams this worker forwards: post_events (engine/
    local.py) hands it each step's events with `call_soon_threadsafe`, and it sends them to the
    daemon at once, on the calling (engine) thread, in one message."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def call_soon_threadsafe(self, callback: Any, items: list[tuple[RequestStream, Any]]) -> None:
        worker = self.worker
        worker.channel.send("events", [(stream.request_id, event) for stream, event in items])
        for stream, event in items:
            if event.finish_reason is not None:
                worker._finished(stream.request_id)


def _progress(engine: ModelEngine) -> tuple[Any, Any]:
    """The engine's turns, and the work done inside the step running now where its backend counts
    it (llama.cpp's graph nodes: backends/llamacpp/interrupt.py). Turns alone judged whole steps,
    and an 8k prefill on a loaded 2-core machine (steps over 10 s) was killed three times as hung."""
    ticks = getattr(getattr(engine, "backend", None), "compute_ticks", None)
    return getattr(engine, "progress", None), ticks() if ticks is not None else None


def _longest_recent_step(engine: ModelEngine) -> float:
    steps = live.steps_since(engine, 0.0)
    return max((s[1] for s in steps), default=0.0)


def _backend_name(engine: ModelEngine) -> str:
    backend = getattr(engine, "backend", None)
    return type(backend).__name__ if backend is not None else type(engine).__name__


def _wire(error: BaseException) -> BaseException:
    """An error as the daemon gets it: ours as they are, anything else as BackendError (its class
    and message in this worker's log only, as the daemon's middleware would keep them)."""
    if isinstance(error, (LocalserveError, asyncio.CancelledError)):
        return error
    return BackendError(f"the engine failed: {type(error).__name__}")


class _PipeHandler(logging.Handler):
    def __init__(self, channel: Channel):
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.send("log", record.levelno, record.name, self.format(record))
        except Exception:  # noqa: BLE001 - logging must never fail the engine
            pass


def _forward_logging(channel: Channel, level: int) -> None:
    """The worker's Python log records (llama.cpp's own log lines among them, backends/llamacpp/
    runtime.py routes them to logging) go to the daemon's log, under their logger's name."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _PipeHandler(channel)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def _stderr_to(path: Path) -> None:
    """fd 2 (and 1) into the worker's log file, truncated: what native code prints before it
    aborts is there for the daemon to read, and a restart starts the file anew."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
