"""The daemon's side of an engine worker: a ModelEngine whose model runs in a child process.

`WorkerEngine.start` forks a worker (child.py) from a fork server, which loads the model with the
loader it is given and answers "ready" with what the daemon needs to know without asking (ModelInfo,
the per-request context). Afterwards every ModelEngine member is a message over the pipe
(channel.py): `generate` and `embed` await their answer, `stats` and the dashboard's live views
wait for it (a pipe round trip: tens of microseconds idle), and one reader thread
hands each "events" message to the streams' event loops with one wakeup per loop, as the in-process
engine does (engine/local.py post_events). A GGUF model's tokenizer calls run here (vocab.py), on a
vocab-only load of the same file (llama.cpp's own tokenizer, so the same ids): they are called on
the event loop, and a round trip waits for the worker's threads to be scheduled, which beside a
busy decode on 2 cores is no longer tens of microseconds; an editor's keystroke tokenizes four texts.

When the worker dies (a native crash, an abort, killed for memory, or by the watchdog below for a
step that stopped moving), each of its requests ends at once with EngineCrashedError (a 503 before
the first byte, the stream's error event after it), the last lines of its native log go to the
daemon's log, and `on_exit` tells the model manager, which loads it again on the next request
(runtime/crashes.py). Nothing else in the daemon notices: other models, /health and the dashboard
go on.

Why a fork server and not plain fork: the daemon has threads (the event loop's executors, other
models' readers) whose locks a fork would copy mid-use; the fork server is a clean, single-threaded
process started once, and each worker forks from it in milliseconds instead of paying a fresh
interpreter. Windows has no fork: there it spawns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ...errors import EngineCrashedError, OverloadedError, redact_paths
from ...protocol.engine import EngineStats, ModelInfo
from ...protocol.media import MediaInput
from ...protocol.requests import GenerationEvent, GenerationRequest, Lane
from .. import core_share
from ..core_share import worker_context
from ..streams import EventQueue, post_events
from .channel import Channel
from .exits import HangReason, describe_exit, native_tail, telling_line, tail_lines
from .rss import rss_bytes
from .vocab import VocabCalls, open_vocab, yield_the_cores

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a worker that takes longer to answer tokenize is hung or dying
# stats and the live views are read on the event loop (ps, /metrics, the dashboard each second): a
# worker that does not answer them this fast is taken as unresponsive, and until its next message
# they answer from what it last said, without asking, so a hung worker never stalls the daemon.
QUICK_CALL_TIMEOUT_S = 0.5
HANG_FLOOR_S = 30.0  # the watchdog never fires sooner than this (unless the ceiling is lower)
HANG_STEP_MULTIPLE = 20.0  # ... nor before this many times the longest recent step


def _context() -> multiprocessing.context.BaseContext:
    ctx = worker_context()
    if ctx.get_start_method() != "forkserver":
        return ctx
    # Imported once in the fork server, so a worker starts with our engine code and llama.cpp's
    # library already loaded: 0.4 s less per load here. Importing llama_cpp only maps the library
    # (no backend is initialised, no thread started, nothing a fork would copy mid-use); backends/
    # sets OpenMP's wait policy before it, as in the daemon. Missing (an ONNX-only install): skipped.
    # The loader's own modules too (the daemon's loader is unpickled from runtime.registry, and it
    # builds engine.local's Engine): 0.3-0.5 s of a cold first token on 2 cores had been their
    # imports in each new worker.
    ctx.set_forkserver_preload(["localserve.engine.worker.child", "localserve.backends.llamacpp.backend",
                                "localserve.runtime.registry", "localserve.engine.local",
                                "localserve.engine.prompt_disk", "localserve.backends.llamacpp.seq_state"])
    return ctx


def prestart_fork_server() -> None:
    """Start the fork server now, so its imports (the preload above: ~0.5 s, 1 s on a busy
    machine) are done before the first load instead of inside it: a daemon that loads on first use
    made the first request wait for them (issue 42's cold first token)."""
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()  # starts the process and returns; it imports on its own


class WorkerStream(EventQueue):
    """EventStream of one request whose events come from the worker."""

    def __init__(self, engine: "WorkerEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        super().__init__(loop)
        self._engine = engine
        self._request_id = request_id
        self._finished = False  # its last event arrived (set on the reader thread)

    @property
    def request_id(self) -> str:
        return self._request_id

    def cancel(self) -> None:
        if not self._finished:
            self._engine.cancel(self._request_id)


class WorkerEngine(VocabCalls):
    """ModelEngine of a model loaded in a worker process (see the module docstring)."""

    def __init__(self, name: str, process: Any, channel: Channel, ready: tuple, log_path: Path | None,
                 hang_timeout: float):
        self.name = name
        self._vocab: Any = None  # a LlamaVocab of the model's GGUF once open (start), else the worker tokenizes
        self._process = process
        self._channel = channel
        self._info: ModelInfo = ready[1]
        self._n_ctx_per_seq: int = ready[2]
        self.backend_name: str = ready[3]
        self.pid: int = ready[4]
        self.rss_before_load: int = ready[5]  # what the process held before the model (child.py)
        self.started_at = time.time()
        self._log_path = log_path
        self._hang_timeout = hang_timeout
        self._ids = itertools.count(1)
        self._streams: dict[str, WorkerStream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # in-flight bookkeeping: streams, calls, the watchdog's event
        self._working = threading.Event()
        self._last_progress = time.monotonic()
        self._longest_step = 0.0
        self._stepped = False  # a step of this engine has ended (its events, or a beat's step time)
        self._last_stats: EngineStats | None = None
        self._unresponsive = False  # a quick call timed out; cleared by the worker's next message
        self._closing = False
        self._kill_reason: str | None = None
        self.exit_reason: str | None = None  # set once the worker ended without being asked to
        self._ended = threading.Event()
        self._exit_callbacks: list[Callable[[str], None]] = []
        threading.Thread(target=self._read, name=f"worker-reader {name}", daemon=True).start()
        threading.Thread(target=self._watch, name=f"worker-watchdog {name}", daemon=True).start()

    @classmethod
    def start(cls, name: str, load: Callable[..., Any], args: tuple, *, log_path: Path | None = None,
              hang_timeout: float = 300.0, log_level: int = logging.INFO,
              vocab_gguf: Path | None = None) -> "WorkerEngine":
        """Start a worker that runs `load(*args)` (the daemon's own loader for this backend) and
        wait for it: the engine once it is ready; the load's own error when the loader raised; a
        BackendError naming the native failure when the worker died while loading. Blocking.
        `vocab_gguf`: the model's GGUF, whose tokenizer then runs in the daemon (opened only once
        the worker has loaded the whole file, so a file that kills llama.cpp's loader kills the
        worker, not us)."""
        from . import child  # not at import time: the daemon imports this module without a worker

        ctx = _context()
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=child.main, args=(theirs, load, args, log_path, log_level, core_share.current()),
                              name=f"localserve engine {name}", daemon=True)
        process.start()
        theirs.close()  # only the worker holds its end now: its death is our EOF
        channel = Channel(ours)
        while True:
            try:
                message = ours.recv()
            except (EOFError, OSError):
                process.join(5)
                reason = describe_exit(process.exitcode)
                tail = native_tail(log_path)
                log.error("the engine worker for %s stopped (%s) while loading%s", name, reason, tail_lines(tail))
                last = redact_paths(telling_line(tail))[:300]
                raise EngineCrashedError(f"the engine for {name} stopped ({reason}) while loading the model"
                                         + (f": {last}" if last else ""), reason) from None
            if message[0] == "log":
                _relay(name, message)
            elif message[0] == "load_failed":
                process.join(10)
                channel.close()
                raise message[1]
            elif message[0] == "ready":
                engine = cls(name, process, channel, message, log_path, hang_timeout)
                log.info("%s runs in engine worker pid %d", name, engine.pid)
                if vocab_gguf is not None:
                    # Off the first request's path (0.15-0.3 s of a cold first token on 2 cores):
                    # until it is open the worker tokenizes, with llama.cpp's same tokenizer.
                    threading.Thread(target=engine._open_vocab, args=(vocab_gguf,), name=f"vocab {name}",
                                     daemon=True).start()
                return engine

    def _open_vocab(self, gguf: Path) -> None:
        yield_the_cores()  # this thread only: the worker's first step runs now
        self._vocab = open_vocab(gguf)

    def resident_bytes(self) -> int | None:
        """The worker's RSS now (rss.py), or None once it is gone; read only when asked."""
        return rss_bytes(self.pid)

    # --- ModelEngine -----------------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx_per_seq(self) -> int:
        return self._n_ctx_per_seq

    async def generate(self, request: GenerationRequest) -> WorkerStream:
        stream = WorkerStream(self, request.request_id, asyncio.get_running_loop())
        with self._lock:
            self._streams[request.request_id] = stream
            self._busy()
        try:
            await asyncio.wrap_future(self._send_call("generate", request))
        except BaseException:
            with self._lock:
                self._streams.pop(request.request_id, None)
                self._idle_if_done()
            self._channel.send("cancel", request.request_id)  # accepted meanwhile: stop it there
            raise
        return stream

    async def embed(self, inputs: list[list[int]], lane: Lane = "default") -> list[list[float]]:
        return await self._pooled("embed", inputs, lane)

    async def rank(self, inputs: list[list[int]], lane: Lane = "default") -> list[float]:
        return await self._pooled("rank", inputs, lane)

    async def _pooled(self, kind: str, inputs: list[list[int]], lane: Lane) -> Any:
        call, future = self._new_call()
        self._send(call, kind, call, inputs, lane)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._channel.send("abandon", call)
            raise

    def cancel(self, request_id: str) -> None:
        self._channel.send("cancel", request_id)

    def tokenize_media(self, text: str, images: list[MediaInput], add_special: bool = True) -> list[int]:
        """In the worker, which holds the projector: each image's positions depend on it."""
        return self._wait("tokenize_media", text, images, add_special)

    def stats(self) -> EngineStats:
        """The worker's figures; the last ones it gave (or zeros) when it cannot answer now, so
        `ps` and the dashboard never fail for a dying worker."""
        try:
            self._last_stats = self._quick("stats")
        except Exception:  # noqa: BLE001
            pass
        return self._last_stats or EngineStats(running=0, waiting={}, kv_used=0, kv_total=0, tokens_per_s=0.0,
                                               prompt_tokens_per_s=0.0, prefix_cache_hits=0, prefix_cache_queries=0,
                                               prefix_cache_hit_rate=0.0, steps=0, busy=False)

    # The dashboard's views (engine/live.py), as the worker's engine computes them; None when it
    # cannot answer (live.py shows nothing then).
    def live_sequences(self) -> Any:
        return self._live("live_sequences")

    def live_steps(self, since: float) -> Any:
        return self._live("live_steps", since)

    def live_parked(self) -> Any:
        return self._live("live_parked")

    def _live(self, view: str, *args: Any) -> Any:
        try:
            return self._quick(view, *args)
        except Exception:  # noqa: BLE001
            return None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker: its engine cancels what runs (each stream ends "cancelled"), frees the
        model, and the process exits; killed if it has not within `timeout` and a grace. Blocking."""
        self._closing = True
        if not self._ended.is_set():
            self._channel.send("shutdown", timeout)
            self._process.join(timeout + 5.0)
            if self._process.is_alive():
                log.warning("the engine worker for %s did not stop in %.0f s; killing it", self.name, timeout + 5)
                self._process.kill()
                self._process.join(5.0)
        self._ended.wait(5.0)
        self._channel.close()

    # --- lifecycle -------------------------------------------------------------------------
    def on_exit(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, on the reader thread, if the worker ends without being
        told to (at once if it already has)."""
        with self._lock:
            if self.exit_reason is None:
                self._exit_callbacks.append(callback)
                return
        callback(self.exit_reason)

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()

    def _read(self) -> None:
        conn = self._channel.conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a message we cannot unpickle: the worker is broken
                log.exception("the engine worker for %s sent a message that cannot be read", self.name)
                self._kill("it sent a message that cannot be read")
                break
            self._last_progress = time.monotonic()
            self._unresponsive = False
            kind = message[0]
            if kind == "events":
                self._stepped = True
                self._deliver(message[1])
            elif kind == "reply" or kind == "fail":
                with self._lock:
                    future = self._calls.pop(message[1], None)
                    self._idle_if_done()
                if future is not None and not future.done():
                    future.set_result(message[2]) if kind == "reply" else future.set_exception(message[2])
            elif kind == "beat":
                self._longest_step = message[2]
                self._stepped = self._stepped or message[2] > 0
            elif kind == "log":
                _relay(self.name, message)
        self._end()

    def _deliver(self, events: list[tuple[str, GenerationEvent]]) -> None:
        items = []
        with self._lock:
            for request_id, event in events:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if event.finish_reason is not None:
                    stream._finished = True
                    del self._streams[request_id]
                items.append((stream, event))
            self._idle_if_done()
        post_events(items)

    def _end(self) -> None:
        """The pipe closed: the worker exited, was told to, or died. End everything it held."""
        self._process.join(5.0)
        core_share.current().forget(self.pid)  # a worker that died inside a step held threads there
        crashed = not self._closing
        reason = self._kill_reason or describe_exit(self._process.exitcode)
        error: Exception
        if crashed:
            log.error("the engine worker for %s (pid %d) stopped (%s)%s", self.name, self.pid, reason,
                      tail_lines(native_tail(self._log_path)))
            error = EngineCrashedError(f"the engine for {self.name} stopped ({reason}) and is being restarted", reason)
        else:
            error = OverloadedError("the model was unloaded")
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            self._working.clear()
            if crashed:
                self.exit_reason = reason
            callbacks, self._exit_callbacks = self._exit_callbacks, []
        finish = GenerationEvent(finish_reason="error", error=error) if crashed else GenerationEvent(
            finish_reason="cancelled")
        for stream in streams:
            stream._finished = True
        # Ended before the streams and calls hear of it: a client that reads its stream's error and
        # then asks `alive` must see the worker gone (the watchdog test read it still alive).
        self._ended.set()
        post_events([(stream, finish) for stream in streams])
        for future in calls:
            if not future.done():
                future.set_exception(error)
        if crashed:
            for callback in callbacks:
                try:
                    callback(reason)
                except Exception:  # noqa: BLE001
                    log.exception("engine exit callback failed")

    def _watch(self) -> None:
        """Kill a worker that holds work and has not moved for the hang limit. Sleeps on an event
        while nothing is in flight: an idle daemon has no wakeups here."""
        while not self._ended.is_set():
            self._working.wait()
            if self._ended.wait(1.0):
                return
            limit = min(self._hang_timeout, max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * self._longest_step))
            silent = time.monotonic() - self._last_progress
            if self._working.is_set() and silent > limit:
                if self._stepped:
                    self._kill(HangReason(f"hung: no progress for {silent:.0f} s"))
                else:
                    self._kill(HangReason(f"hung in its first step: no progress for {silent:.0f} s", first_step=True))
                return

    def _kill(self, reason: str) -> None:
        self._kill_reason = reason
        log.error("killing the engine worker for %s (pid %d): %s", self.name, self.pid, reason)
        self._process.kill()

    # --- calls -----------------------------------------------------------------------------
    def _new_call(self) -> tuple[int, concurrent.futures.Future]:
        call = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._ended.is_set():
                future.set_exception(self._gone())
            else:
                self._calls[call] = future
                self._busy()
        return call, future

    def _send(self, call: int, *message: Any) -> None:
        if not self._channel.send(*message):
            with self._lock:
                future = self._calls.pop(call, None)
                self._idle_if_done()
            if future is not None and not future.done():
                future.set_exception(self._gone())

    def _send_call(self, kind: str, *args: Any) -> concurrent.futures.Future:
        call, future = self._new_call()
        self._send(call, kind, call, *args)
        return future

    def _quick(self, method: str, *args: Any) -> Any:
        if self._unresponsive:
            raise OverloadedError(f"the engine for {self.name} is not answering")
        try:
            return self._wait(method, *args, timeout=QUICK_CALL_TIMEOUT_S)
        except OverloadedError:
            self._unresponsive = True
            raise

    def _wait(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        future = self._send_call("call", method, args)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise OverloadedError(f"the engine for {self.name} did not answer in {timeout:g} s") from None

    def _gone(self) -> Exception:
        if self.exit_reason is not None:
            return EngineCrashedError(f"the engine for {self.name} stopped ({self.exit_reason}) and is being "
                                      "restarted", self.exit_reason)
        return OverloadedError("the model is not running; retry shortly")

    def _busy(self) -> None:
        """Under the lock: work is in flight; the watchdog counts from now if it was idle."""
        if not self._working.is_set():
            self._last_progress = time.monotonic()
            self._working.set()

    def _idle_if_done(self) -> None:
        if not self._streams and not self._calls:
            self._working.clear()


def _relay(name: str, message: tuple) -> None:
    """A worker's log record, into the daemon's log under its logger's name, filtered by the
    daemon's own logging configuration."""
    _, level, logger_name, text = message
    logger = logging.getLogger(logger_name)
    if logger.isEnabledFor(level):
        logger.log(level, "[%s] %s", name, text)
