"""A ModelEngine over onnxruntime-genai's own batching engine (`og.Engine`), for OGA folders.

Why og.Engine rather than one og.Generator per request: the Engine batches concurrent requests
into shared `session.run`s by itself (its static-batch scheduler on the CPU EP: up to 4 requests
per batch in 0.18; continuous batching on EPs with PagedAttention), takes per-request sampling
options, seeds and cancellation, and is the runtime vendors tune their NPU folders for. Generators
would serve each request with its own `session.run` per token. The price on the CPU EP: a static
batch admits no request while it runs, so a request that arrives then waits for the whole batch
(measured: 8.6 s behind a 120-token answer that had started 0.1 s before it). That is OGA's
scheduling, kept as it is, since this engine exists to serve vendor folders the way OGA serves them.

OGA's Engine must be driven from the thread that created it (its owner-thread contract), so one
engine thread owns the og.Engine, every og.Request and every `run()`: the event loop only puts
requests into an inbox and flags cancels, as with engine.Engine. Per-request text, stop strings,
finish reasons and usage reuse the scheduler's `Sequence` (UTF-8-safe deltas, stop strings never
emitted) and the streams are engine.RequestStream, so both engines answer in the same shape.
Stop strings are ours, not OGA's: a hit finishes the request at once and cancels its OGA turn.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from ...backends.base import SampledToken
from ...batching.sequence import Sequence
from ..rates import Rates
from ..streams import STREAM_BUFFER_EVENTS, RequestStream, post_events
from ...protocol.engine import EngineStats, ModelInfo
from ...errors import GenerationError, InvalidRequestError, LocalserveError, OverloadedError, QueueFullError, redact_paths
from ...protocol.requests import LANES, GenerationRequest, Lane, check_request
from .params import check_supported, turn_options
from .vocab import OgaVocab

log = logging.getLogger(__name__)

EVENT_BUFFER = 256  # events one run() may return: one per request per step, and a few finishes


class OgaEngine:
    """ModelEngine (engine_api.py) for one og.Model; `start()` before use, `shutdown()` to free it."""

    stream_buffer_events = STREAM_BUFFER_EVENTS

    def __init__(self, og: Any, model: Any, vocab: OgaVocab, info: ModelInfo, *, name: str,
                 n_ctx_per_seq: int, eog: set[int], queue_size: int = 64, seeds: bool = False) -> None:
        self.name = name
        self._og, self._model, self._vocab, self._info = og, model, vocab, info
        self._n_ctx = n_ctx_per_seq
        self._eog = frozenset(eog)
        self._queue_size = queue_size
        self._seeds = seeds  # whether og.Engine takes per-request seeds (its dynamic batching only)
        self._cond = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._live: dict[int, tuple[Sequence, Any, int]] = {}  # id(og request) -> (seq, og request, turn)
        self._updates: list[Sequence] = []
        self._rates = Rates()
        self._stopping = False
        self._busy = False
        self._steps = 0
        self._n_cancelled = 0
        self.max_batch = 0  # OGA's configured batch size, read once the engine thread made its Engine
        self.constraints = False  # whether this onnxruntime-genai build accepts JSON-schema guidance
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- ModelEngine -----------------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx_per_seq(self) -> int:
        return self._n_ctx

    def start(self, timeout: float = 60.0) -> None:
        """Start the engine thread and wait until its og.Engine exists (its errors are raised here)."""
        self._thread = threading.Thread(target=self._run, name=f"oga-{self.name}", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self._start_error is not None:
            raise self._start_error

    async def generate(self, request: GenerationRequest) -> RequestStream:
        if self._stopping:
            raise OverloadedError("the model is unloading; retry shortly", retry_after=1.0)
        check_request(request, self._n_ctx, self._info.n_vocab)
        check_supported(request.sampling, self.constraints, self._seeds)
        if len(self._inbox) + len(self._live) >= self._queue_size + self.max_batch:
            raise QueueFullError(f"onnxruntime-genai's queue is full ({self._queue_size} requests waiting)",
                                 retry_after=5.0)
        seq = Sequence(request, None, self._vocab.token_to_bytes, self._eog.__contains__, self._n_ctx)
        stream = RequestStream(seq, asyncio.get_running_loop(), self._wake, self.stream_buffer_events)
        seq.stream = stream
        with self._cond:
            self._inbox.append(seq)
            self._cond.notify()
        return stream

    async def embed(self, inputs: list[list[int]], lane: Lane = "default") -> list[list[float]]:
        raise InvalidRequestError("this model's backend does not compute embeddings "
                                  "(onnxruntime-genai folders generate text only)", param="model")

    async def rank(self, inputs: list[list[int]], lane: Lane = "default") -> list[float]:
        raise InvalidRequestError(f"model {self.name} is not a reranker (onnxruntime-genai folders generate text only)",
                                  param="model")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        tokens = self._vocab.encode(text)
        bos = self._vocab.bos_added
        if not add_special and bos is not None and tokens[:1] == [bos]:
            return tokens[1:]
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self._vocab.token_to_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        # A special token's text is its piece as written (tokenizer.json's added tokens).
        return [self._vocab.piece(t).encode("utf-8") if t in self._vocab.special else self._vocab.token_to_bytes(t)
                for t in tokens]

    def stats(self) -> EngineStats:
        decode_rate, prompt_rate = self._rates.tokens_per_s()
        waiting = dict.fromkeys(LANES, 0)
        for seq in list(self._inbox):
            waiting[seq.request.lane] += 1
        return EngineStats(running=len(self._live), waiting=waiting, kv_used=0, kv_total=0,
                           tokens_per_s=round(decode_rate, 2), prompt_tokens_per_s=round(prompt_rate, 2),
                           prefix_cache_hits=0, prefix_cache_queries=0, prefix_cache_hit_rate=0.0,
                           steps=self._steps, busy=self._busy, max_sequences=self.max_batch,
                           cancelled=self._n_cancelled)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _wake(self) -> None:  # RequestStream.cancel calls it
        with self._cond:
            self._cond.notify()

    # --- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._og.Engine(self._model)
            buffer = engine.create_event_buffer(EVENT_BUFFER)
            self.max_batch = int(engine.get_capabilities().configured_max_batch_size)
            self.constraints = self._probe_guidance(engine)
        except Exception as e:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._wait(engine):
                self._admit(engine)
                self._cancel_flagged()
                if engine.has_pending_requests():
                    self._step(engine, buffer)
                self._deliver()
        except Exception:  # noqa: BLE001 - a failed run must not leave every stream hanging
            log.exception("%s: onnxruntime-genai engine failed", self.name)
            self._finish_all("error", GenerationError("the onnxruntime-genai engine failed while serving this request"))
        finally:
            self._finish_all("cancelled")
            self._deliver()
            # Destroyed on its owner thread (it closes every request still bound to it), and the
            # model with it, so an unload frees the weights without waiting for this object to go.
            del engine
            self._model = None

    def _wait(self, engine: Any) -> bool:
        """Sleep until there is work; False once shutting down."""
        with self._cond:
            while not (self._stopping or self._inbox or engine.has_pending_requests()
                       or any(seq.cancelled for seq, _, _ in self._live.values())):
                self._busy = False
                self._cond.wait()
            self._busy = not self._stopping
            return not self._stopping

    def _probe_guidance(self, engine: Any) -> bool:
        request = engine.create_request()
        try:
            self._og.TurnOptions(request).set_guidance("json_schema", '{"type": "object"}')
            return True
        except Exception:  # noqa: BLE001 - a build without guidance raises here
            return False
        finally:
            request.close()

    def _admit(self, engine: Any) -> None:
        while self._inbox:
            with self._cond:
                seq = self._inbox.popleft()
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            og_request = engine.create_request()
            try:
                turn = og_request.begin_turn(np.asarray(seq.request.prompt_tokens, dtype=np.int32),
                                             turn_options(self._og, og_request, seq.request))
            except Exception as e:  # noqa: BLE001 - OGA refused this request only
                og_request.close()
                self._finish(seq, "error", GenerationError(redact_paths(f"onnxruntime-genai refused the request: {e}")[:300]))
                continue
            seq.t_scheduled = time.monotonic()
            self._live[id(og_request)] = (seq, og_request, turn)

    def _cancel_flagged(self) -> None:
        for key, (seq, og_request, turn) in list(self._live.items()):
            if seq.cancelled:
                self._drop(key, "cancelled")

    def _step(self, engine: Any, buffer: Any) -> None:
        t0 = time.monotonic()
        events = engine.run(buffer)
        self._steps += 1
        decoded = prompts = 0
        flags = self._og.EngineEventFlags
        for ev in events or ():
            entry = self._live.get(id(ev.request)) if ev.request is not None else None
            if entry is None:
                if ev.flags & flags.FAILED and ev.request is None:  # an engine-level failure
                    raise RuntimeError(f"engine failure (error code {ev.error_code})")
                continue  # a request we already finished (our stop string, a cancel)
            seq = entry[0]
            if ev.flags & flags.TOKEN:
                prompts += 0 if seq.num_generated else seq.num_prompt
                decoded += 1
                reason = seq.append(SampledToken(int(ev.token)))
                if reason is not None:
                    self._drop(id(ev.request), reason)
                    continue
                self._updates.append(seq)
            if ev.flags & flags.TURN_FINISHED:
                self._drop(id(ev.request), *self._finish_reason(ev))
        t1 = time.monotonic()
        self._rates.step(t1, t1 - t0, decoded, prompts)

    def _finish_reason(self, ev: Any) -> tuple[str, LocalserveError | None]:
        r = self._og.FinishReason
        reason = ev.finish_reason
        if reason in (r.EOS, r.STOP_STRING):
            return "stop", None
        if reason in (r.MAX_GENERATED_TOKENS, r.MAX_SESSION_TOKENS):
            return "length", None
        if reason == r.CANCELLED:
            return "cancelled", None
        return "error", GenerationError(f"onnxruntime-genai failed this request (error code {int(ev.error_code)})")

    def _drop(self, key: int, reason: str, error: LocalserveError | None = None) -> None:
        """Finish the request and let go of its OGA request (cancelling a turn still running)."""
        seq, og_request, turn = self._live.pop(key)
        try:
            og_request.cancel_turn(turn)  # False, harmlessly, when the turn already ended
            og_request.close()
        except Exception:  # noqa: BLE001 - a request OGA already released
            log.debug("%s: closing a finished request failed", self.name, exc_info=True)
        self._finish(seq, reason, error)

    def _finish(self, seq: Sequence, reason: str, error: LocalserveError | None = None) -> None:
        if not seq.finished:
            seq.mark_finished(reason, error)  # type: ignore[arg-type]
            self._n_cancelled += reason == "cancelled"
            self._rates.finished(1)
            self._updates.append(seq)

    def _finish_all(self, reason: str, error: LocalserveError | None = None) -> None:
        for key in list(self._live):
            self._drop(key, reason, error)
        while self._inbox:
            self._finish(self._inbox.popleft(), reason, error)

    def _deliver(self) -> None:
        """This step's events to their loops: one wakeup per loop per step, as engine.Engine."""
        updates, self._updates = self._updates, []
        post_events([(seq.stream, event) for seq in dict.fromkeys(updates)
                     if (event := seq.take_event()) is not None])
