"""One loaded model: a backend and a scheduler driven by one engine thread.

    while running: plan = scheduler.schedule(); result = step.run(backend, plan); scheduler.postprocess(plan, result)

The scheduler never calls the backend: its plan carries the KV-cache operations (batching/kv_ops.py)
and the batch, and step.py is the one place a step touches the model.

Requests enter through a thread-safe inbox; each step's output goes back to the asyncio loop that
submitted it with one `call_soon_threadsafe` per loop per step (one per token per request would
wake the loop up to 16x more often for nothing). The event loop never waits for model work:
ctypes releases the GIL while llama.cpp computes. The thread sleeps on a condition when idle.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

from ..backends.common import sampler_thread
from ..backends.base import Backend, Sampler, declared_capabilities
from ..batching.limits import EngineLimits
from ..protocol.media import MediaInput
from ..protocol.requests import LANES, GenerationRequest, Lane, check_request, lora_set
from ..batching.scheduler import Scheduler
from ..batching.sequence import Sequence
from ..batching.step_plan import StepOutput, StepPlan
from . import step
from ..protocol.engine import EngineStats, ModelInfo
from ..errors import ContextLengthExceededError, InvalidRequestError, OverloadedError, QueueFullError
from .live import SequenceProgress, cells_of, progress_rows
from .rates import Rates
from .prompt_disk import PromptDisk
from .streams import STREAM_BUFFER_EVENTS, RequestStream, post_events
from . import core_share
from .threads import ThreadGovernor

log = logging.getLogger(__name__)

# Seconds an unload waits for the prompt cache's last writes (a worker is given 5 s to stop).
_UNLOAD_WRITE_S = 4.0
@dataclass
class _EmbedJob:
    """An embeddings or rerank request's decodes (Backend.embed_steps, rank_steps), run in turns."""

    steps: Generator[bool, None, Any]
    future: concurrent.futures.Future
    started: bool = False
    cancelled: bool = False  # set from the event loop when the caller goes away


class Engine:
    """The ModelEngine (engine_api.py) of a step-level Backend run by our Scheduler."""

    stream_buffer_events = STREAM_BUFFER_EVENTS

    def __init__(self, backend: Backend, limits: EngineLimits, name: str = "", prompt_disk: PromptDisk | None = None):
        self._backend = backend
        self.limits = limits
        self.name = name or backend.info.name
        self.scheduler = Scheduler(declared_capabilities(backend), limits, on_dequeue=self._dequeued)
        # The prompt cache on disk (prompt_disk.py): parked entries written while idle and at
        # unload, read back on a prefix hit.
        self.prompt_disk = prompt_disk
        self.scheduler.cache.disk = prompt_disk
        self._threads = (ThreadGovernor(backend, share=core_share.current())
                         if limits.adaptive_threads and backend.adjustable_threads and backend.n_threads > 1 else None)
        self._cond = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._embeds: collections.deque[_EmbedJob] = collections.deque()
        self._queued = dict.fromkeys(LANES, 0)  # submitted, not yet started (bounded per lane)
        self._queued_lock = threading.Lock()
        self._active: dict[str, Sequence] = {}
        self._media_held: dict[str, object] = {}  # request id -> what the backend keeps of its images
        self._token_bytes_cache: dict[int, bytes] = {}
        self._rates = Rates()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._busy = False
        self._in_flight: StepPlan | None = None  # the step being computed (read by submit's thread)
        self._n_cancelled = 0
        # Turns of the engine loop that did work (a step, an embeddings decode): a worker's
        # heartbeat sends it, and a count that stops moving while work is held is a hang.
        self.progress = 0

    # --- public API ------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """For tests and benchmarks only; callers above the engine use the ModelEngine members."""
        return self._backend

    @property
    def info(self) -> ModelInfo:
        return self._backend.info

    @property
    def n_ctx_per_seq(self) -> int:
        return self.scheduler.n_ctx_seq

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
            self._thread.start()

    def submit(self, request: GenerationRequest, sampler: Sampler | None = None) -> RequestStream:
        """Queue a request; call from the asyncio loop that will consume the stream. `sampler`:
        one already built for it (generate)."""
        if self._stopping:
            raise OverloadedError("the model is unloading; retry shortly", retry_after=1.0)
        self._validate(request)
        if not request.images:
            return self._enqueue(request, sampler)
        # Its images' chunks stay with the backend until it finishes (_deliver gives them back).
        self._media_held[request.request_id] = self._backend.hold_media(request.prompt_tokens, request.images)
        try:
            return self._enqueue(request, sampler)
        except BaseException:
            self._release_media(request.request_id)
            raise

    def _enqueue(self, request: GenerationRequest, sampler: Sampler | None) -> RequestStream:
        lane = request.lane
        with self._queued_lock:
            if self._queued[lane] >= self.limits.queue_size:
                raise QueueFullError(
                    f"the {lane} queue is full ({self.limits.queue_size} requests waiting)",
                    retry_after=self._retry_after(self._queued[lane]),
                )
            self._queued[lane] += 1
        try:
            # Built here, not on the engine thread, so a bad grammar or schema is the caller's
            # 400 at once rather than an "error" finish later.
            sampler = sampler or self._backend.new_sampler(request.sampling, request.prompt_tokens)
        except BaseException:
            self._dequeued_lane(lane)
            raise
        seq = Sequence(request, sampler, self._token_bytes, self._backend.is_eog, self.n_ctx_per_seq)
        stream = RequestStream(seq, asyncio.get_running_loop(), self._wake, self.stream_buffer_events)
        seq.stream = stream
        self._active[request.request_id] = seq
        self._inbox.append(seq)
        if self._goes_before_the_step(seq):
            self._backend.interrupt()
        self._wake()
        return stream

    def _goes_before_the_step(self, seq: Sequence) -> bool:
        """Whether `seq`, just submitted, should stop the step being computed (the backend stops
        only a step planned as interruptible). Between steps: as for a step of batch work alone,
        and the flag is cleared when the next plan takes `seq` in."""
        return self.scheduler.goes_before(seq, self._in_flight_yields_to())

    def _in_flight_yields_to(self) -> tuple[int, int] | None:
        plan = self._in_flight  # read once: the engine thread replaces it
        return None if plan is None else plan.yields_to

    async def generate(self, request: GenerationRequest) -> RequestStream:
        """ModelEngine.generate: submit, with a constrained request's sampler built on a sampler
        thread: compiling a schema and parsing its grammar must not stall the event loop every
        client shares."""
        sampling = request.sampling
        if sampling.grammar is None and sampling.json_schema is None:
            return self.submit(request)
        self._validate(request)  # cheap refusals first, before any grammar work
        sampler = await asyncio.wrap_future(
            sampler_thread.submit(self._backend.new_sampler, sampling, request.prompt_tokens))
        try:
            return self.submit(request, sampler)
        except BaseException:
            sampler.close()  # refused (queue full, unloading): free its native grammar now
            raise

    def cancel(self, request_id: str) -> None:
        seq = self._active.get(request_id)
        if seq is not None:
            seq.cancelled = True
            self._wake()

    async def embed(self, inputs: list[list[int]], lane: Lane = "default") -> list[list[float]]:
        """The inputs' vectors, computed on the engine thread one decode at a time between
        generation steps (see _advance_embed), so a huge request neither races a decode nor holds
        up the running streams. Cancelling the awaiting task stops the work at the next decode."""
        if not self._backend.capabilities.embeddings:
            # A backend without embeddings (an ONNX graph converted before it had the embeddings
            # output, the static flavour) would fail on the engine thread: a 500.
            raise InvalidRequestError("this model's backend does not compute embeddings", param="model")
        self._check_pooled(inputs, "input", "embedding input", "embeds")
        return await self._pooled_job(self._backend.embed_steps, inputs, lane)

    async def rank(self, inputs: list[list[int]], lane: Lane = "default") -> list[float]:
        """A reranker's scores of the pairs, computed as `embed` computes vectors: in turns with
        the embeddings jobs, between generation steps."""
        if self.info.rerank is None:
            raise InvalidRequestError(f"model {self.name} is not a reranker", param="model")
        self._check_pooled(inputs, "documents", "query and document pair", "ranks")
        return await self._pooled_job(lambda pairs: self._backend.rank_steps(pairs, self._pooled_room), inputs, lane)

    def _pooled_room(self, most: int) -> int:
        """(Engine thread.) Tokens one rerank decode may take: all it could with nothing decoding,
        else what the step clock lets a batch-lane prompt chunk add to a step (as long as the
        running decodes' own step, or the target), so the chats beside it keep a share of their
        pace. benchmarks/rerank.py on a busy 2-core machine (other work beside, so the two runs'
        loads differ): with 512-token rerank decodes between their steps two chats fell from 16.8
        to 0.2 tokens/s; sized so, from 57.0 to 15.2."""
        decoders = len(self.scheduler.running)
        return self.scheduler.clock.prompt_tokens_within(most, decoders) if decoders else most

    def _check_pooled(self, inputs: list[list[int]], param: str, what: str, verb: str) -> None:
        if not inputs or any(not tokens for tokens in inputs):
            raise InvalidRequestError(f"every {what} needs at least one token", param=param)
        for i, tokens in enumerate(inputs):
            if len(tokens) > self.n_ctx_per_seq:
                raise ContextLengthExceededError(
                    f"{what} {i} has {len(tokens)} tokens; this model {verb} at most {self.n_ctx_per_seq}",
                    param=param,
                )

    async def _pooled_job(self, steps: Callable[[list[list[int]]], Generator[bool, None, Any]],
                          inputs: list[list[int]], lane: Lane) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping or self._thread is None:
            raise OverloadedError("the model is not running; retry shortly")
        job = _EmbedJob(steps(inputs), future)
        self._embeds.append(job)
        # Only a step of batch work alone stops for it: the batch runner's embeddings lines must not
        # keep stopping a chat batch, and an editor's stream of embeddings must not keep stopping a
        # long prompt's chunks (each would be redone: the prompt would never be read).
        if lane != "batch" and self._in_flight_yields_to() is None:
            self._backend.interrupt()
        self._wake()
        try:
            return await asyncio.wrap_future(future)
        finally:
            job.cancelled = True  # no-op once finished; otherwise the engine drops the rest
            self._wake()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._backend.tokenize(text, add_special=add_special)

    def tokenize_media(self, text: str, images: list[MediaInput], add_special: bool = True) -> list[int]:
        """A prompt with one MEDIA_MARKER per image: its ids, each image's positions negative ids
        (backends/llamacpp/media.py). InvalidRequestError for a model that takes no images."""
        return self._backend.tokenize_media(text, images, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self._token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        return [self._backend.token_to_bytes(t, special=True) for t in tokens]

    def in_flight(self) -> dict[str, Sequence]:
        """request id -> its sequence, for every request held (queued ones too): a copy, for
        readers on other threads (the dashboard), a step stale at most."""
        return self._active.copy()

    def recent_steps(self, since: float) -> list[tuple[float, float, int, int]]:
        return self._rates.steps_since(since)

    # The dashboard's views (live.py): copies, read from the event loop while the thread works.
    def live_sequences(self) -> dict[str, SequenceProgress]:
        return progress_rows(self.in_flight(), self.scheduler.stalled_s)

    def live_steps(self, since: float) -> list[tuple[float, float, int, int]]:
        return self.recent_steps(since)

    def live_parked(self) -> int:
        # One C-level copy: the engine thread may re-key the cache meanwhile.
        return cells_of(list(self.scheduler.cache.parked.values()))

    def stats(self) -> EngineStats:
        s = self.scheduler
        decode_rate, prompt_rate = self._rates.tokens_per_s()
        waiting = s.lanes.counts()
        for seq in list(self._inbox):
            waiting[seq.request.lane] += 1
        return EngineStats(
            running=len(s.running),
            waiting=waiting,
            kv_used=s.pool.used,
            kv_total=s.pool.n_cells,
            tokens_per_s=round(decode_rate, 2),
            prompt_tokens_per_s=round(prompt_rate, 2),
            prefix_cache_hits=s.cache.hits,
            prefix_cache_queries=s.cache.queries,
            prefix_cache_hit_rate=round(s.cache.hits / s.cache.queries, 4) if s.cache.queries else 0.0,
            steps=s.step,
            busy=self._busy,
            preemptions=s.preemptions,
            interrupted_steps=s.interrupted_steps,
            parked=len(s.cache.parked),
            max_sequences=s.max_running,
            kv_moves=s.pool.moves,
            cancelled=self._n_cancelled,
            speculative=s.drafts.mode if s.drafts is not None else "off",
            draft_tokens=dict(s.drafts.drafted) if s.drafts is not None else {},
            draft_accepted=dict(s.drafts.accepted) if s.drafts is not None else {},
            draft_verifications=s.drafts.verifications if s.drafts is not None else 0,
            compute_threads=self._threads.threads if self._threads is not None else self._backend.n_threads,
        )

    def active_requests(self) -> int:
        return len(self._active)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything in flight (each stream ends "cancelled"), stop and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
        elif not self._stopped.is_set():
            self._drain_on_stop()  # never started: finish what was submitted right here

    # --- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                memory_due = self._backend.release_idle_memory(time.monotonic())  # KV streams left empty
                memory_at = None if memory_due is None else time.monotonic() + memory_due
                with self._cond:
                    while not (self._stopping or self._inbox or self._embeds or self.scheduler.has_work()):
                        if self._busy and self._threads is not None:
                            self._threads.idle()
                        self._busy = False
                        # A timed wait only while a parked entry waits to be written or released,
                        # or memory to be given back: idle is 0% CPU.
                        now = time.monotonic()
                        due = [d for d in (self.scheduler.cache.next_idle_work_in(now),
                                           None if memory_at is None else memory_at - now) if d is not None]
                        due_in = min(due, default=None)
                        if due_in is not None and due_in <= 0:
                            break
                        self._cond.wait(due_in)
                    if self._stopping:
                        break
                    self._busy = True
                try:
                    self._take_inbox()
                    if self._embeds:
                        self._advance_embed()
                    if self.scheduler.has_work():
                        self._step()
                    elif self.scheduler.cache.idle_work(time.monotonic()):  # idle: write, release what is due
                        self._deliver(self.scheduler.take_output())
                    self.progress += 1
                except Exception:  # a bug in delivery must not leave every stream hanging
                    log.exception("engine loop error")
                    self.scheduler.fail_running("internal error while serving this request")
                    self._deliver(self.scheduler.take_output())
        finally:
            self._drain_on_stop()

    def _step(self) -> None:
        t0 = time.monotonic()
        plan = None
        if self._threads is not None:
            self._threads.before_step()
        try:
            plan = self.scheduler.schedule()  # pure planning: KV operations, then which tokens
            self._in_flight = plan
            try:
                result = step.run(self._backend, plan)  # KV ops, decode, sample; failures as data
            finally:
                self._in_flight = None
                if self._threads is not None:
                    self._threads.after_step()  # our other engines may compute while we postprocess
            output = self.scheduler.postprocess(plan, result)  # advance, finish, or undo and make room
        except Exception:  # a scheduler bug must not kill the engine: fail this step's requests
            log.exception("engine step failed")
            self.scheduler.fail_running("internal error while scheduling this request")
            output = self.scheduler.take_output()
        if plan is not None and plan.batch:  # counted before delivery: a finished stream's step is in the figures
            t1 = time.monotonic()
            self._rates.step(t1, t1 - t0, plan.decode_tokens, plan.prompt_tokens)
        self._deliver(output)

    def _deliver(self, output: StepOutput) -> None:
        """Give back the cells of what finished (now, not with the next plan, so an idle engine's
        cache holds what its books say, and a backend handed to a fresh engine is as empty as its
        books), then hand the events to their loops: one wakeup per loop per step."""
        try:
            step.apply_kv_ops(self._backend, output.kv_ops)
        except Exception:  # the next plan starts from books the cache may not match: fail what runs
            log.exception("releasing KV cells failed")
            self.scheduler.fail_running("internal error while freeing this request's memory")
            # Those failures' events now; their releases stay in the books' list for the next plan.
            output.updated += self.scheduler.take_output(kv_ops=False).updated
        items = []
        n_finished = 0
        for seq in output.updated:
            event = seq.take_event()
            if event is None:
                continue
            if event.finish_reason is not None:
                n_finished += 1
                self._n_cancelled += event.finish_reason == "cancelled"
                self._active.pop(seq.request_id, None)
                self._release_media(seq.request_id)
            items.append((seq.stream, event))
        if n_finished:
            self._rates.finished(n_finished)
        post_events(items)

    def _take_inbox(self) -> None:
        # Cleared before taking: what arrived until now is in the next plan, and what arrives
        # after this sets it again.
        self._backend.clear_interrupt()
        inbox = self._inbox
        while inbox:
            self.scheduler.add(inbox.popleft())

    def _advance_embed(self) -> None:
        """One decode of the oldest embeddings job. Jobs take turns where their generator says the
        backend holds nothing of them, so a small request is not stuck behind a huge one."""
        job = self._embeds[0]
        if not job.started:
            job.started = True
            if not job.future.set_running_or_notify_cancel():  # its caller left before it began
                job.cancelled = True
        if job.cancelled:
            self._embeds.popleft()
            job.steps.close()  # clears the backend's embeddings state
            if job.future.running():
                job.future.set_exception(asyncio.CancelledError())
            return
        if self._threads is not None:
            self._threads.before_step()
        try:
            may_switch = next(job.steps)  # one decode
        except StopIteration as done:
            self._embeds.popleft()
            job.future.set_result(done.value)
            return
        except Exception as e:  # noqa: BLE001 - the caller's error (bad input, backend failure)
            self._embeds.popleft()
            job.future.set_exception(e)
            return
        finally:
            if self._threads is not None:
                self._threads.after_step()
        if may_switch and len(self._embeds) > 1:
            self._embeds.rotate(-1)

    def _drain_on_stop(self) -> None:
        self._take_inbox()
        self.scheduler.finish_all("cancelled")
        self.scheduler.cache.save_parked()  # an unload: what is parked goes to disk, due or not
        self._deliver(self.scheduler.take_output())
        if self.prompt_disk is not None and not self.prompt_disk.flush(_UNLOAD_WRITE_S):
            log.warning("prompt cache: writes still pending after %.0f s at unload", _UNLOAD_WRITE_S)
        while self._embeds:
            job = self._embeds.popleft()
            job.steps.close()
            if job.started or job.future.set_running_or_notify_cancel():
                job.future.set_exception(OverloadedError("the model was unloaded"))
        self._busy = False
        if self._threads is not None:
            self._threads.close()
        self._stopped.set()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # --- helpers ---------------------------------------------------------------------------
    def _validate(self, request: GenerationRequest) -> None:
        check_request(request, self.n_ctx_per_seq, self._backend.info.n_vocab)
        request.lora = lora_set(request.lora, len(self._backend.info.loras), self.name)

    def _retry_after(self, queued: int) -> float:
        """Seconds until the queue has likely moved by this many requests, from recent completions."""
        rate = self._rates.finishes_per_s()
        if rate <= 0:
            return 5.0
        return float(min(300.0, max(1.0, round(queued / rate, 1))))

    def _release_media(self, request_id: str) -> None:
        held = self._media_held.pop(request_id, None)
        if held is not None:
            self._backend.release_media(held)

    def _dequeued(self, seq: Sequence) -> None:
        self._dequeued_lane(seq.request.lane)

    def _dequeued_lane(self, lane: str) -> None:
        with self._queued_lock:
            self._queued[lane] -= 1

    def _token_bytes(self, token: int) -> bytes:
        data = self._token_bytes_cache.get(token)
        if data is None:
            data = self._token_bytes_cache[token] = self._backend.token_to_bytes(token)
        return data
