"""What both API dialects do the same way: prompt building, submitting, watching the client, collecting.

Every generation goes through `generation()`: pin the model (ModelManager.use), build its engine
requests, submit all of them or none, hand the streams to the caller, cancel them in a `finally`.
Only ModelEngine members (engine_api.py) are used, so any engine serves both dialects.

No HTTP here: the routes (server/) run each generation under server/disconnect.guard_disconnect,
and every stream is cancelled in a `finally`: the engine drops the sequence at its next step and
frees its KV cells (and itself stops a sequence whose stream holds engine.STREAM_BUFFER_EVENTS
unread events).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from ..protocol.engine import EventStream, ModelEngine
from ..protocol.media import MediaInput
from ..errors import (ContextLengthExceededError, EngineCrashedError, GenerationError, InvalidRequestError,
                      RequestCancelledError, SwapPreemptedError)
from ..protocol.requests import GenerationEvent, GenerationRequest, Lane, TokenLogprob, Usage
from .errors import ClientGone
from .live import ORIGIN, cancelled_by
from .templates import ChatTemplate

if TYPE_CHECKING:
    from ..runtime.manager import ModelManager
    from .images import ImageParts

log = logging.getLogger(__name__)
LONG_PROMPT_CHARS = 20_000  # tokenize longer texts in a thread so the event loop keeps serving
T = TypeVar("T")


def chat_template(engine: ModelEngine) -> ChatTemplate:
    info = engine.info
    return ChatTemplate.for_model(info.chat_template, info.bos_token, info.eos_token, engine.name)


def tokenize_prompt(engine: ModelEngine, text: str, template: ChatTemplate | None = None, *,
                    add_special: bool = True, images: Sequence[MediaInput] = ()) -> list[int]:
    """Tokens of a prompt. A rendered template that already starts with BOS must not get a second
    one from the tokenizer (a doubled BOS measurably degrades Llama-family answers); nor does a
    continuation (`add_special=False`), whose earlier turn already began with BOS.

    `images`: one per MEDIA_MARKER in `text`, in order; each takes its positions in the tokens
    (negative ids, the engine's own: the same image, the same ids, so the prefix cache reuses it).
    Audio clips (AudioInput) likewise. Only an engine whose projector takes them (`info.vision`,
    `info.audio`) does (InvalidRequestError otherwise); with a worker this is a round trip to it,
    where the projector is."""
    has_bos = bool(template and template.bos_token and text.startswith(template.bos_token))
    add_special = add_special and not has_bos
    if not images:
        return list(engine.tokenize(text, add_special=add_special))
    tokenize_media = getattr(engine, "tokenize_media", None)
    if tokenize_media is None or not (engine.info.vision or engine.info.audio):
        raise InvalidRequestError(f"the model {engine.name} does not take images or audio", param="model")
    return list(tokenize_media(text, list(images), add_special))


async def off_loop_if_long(chars: int, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`work(*args, **kwargs)`, in a worker thread when it tokenizes more than LONG_PROMPT_CHARS
    characters (`chars`), so the event loop keeps serving every other client meanwhile; inline
    below that, where a thread hop would cost more than the work."""
    if chars > LONG_PROMPT_CHARS:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)


async def tokenize_async(engine: ModelEngine, text: str, template: ChatTemplate | None = None, *,
                         add_special: bool = True, images: Sequence[MediaInput] = ()) -> list[int]:
    # With images always off the loop: decoding and preprocessing them (in the engine's worker)
    # takes milliseconds to seconds.
    chars = LONG_PROMPT_CHARS + 1 if images else len(text)
    return await off_loop_if_long(chars, tokenize_prompt, engine, text, template, add_special=add_special,
                                  images=images)


def is_token_list(items: Any) -> bool:
    return isinstance(items, list) and bool(items) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def check_tokens(tokens: list[int], n_vocab: int, param: str) -> list[int]:
    if any(not 0 <= t < n_vocab for t in tokens):
        raise InvalidRequestError(f"'{param}' holds token ids outside the vocabulary (0..{n_vocab - 1})", param=param)
    return tokens


async def embed_inputs(engine: ModelEngine, inputs: Sequence[str | list[int]], *, truncate: bool, param: str,
                       max_tokens: int) -> list[list[int]]:
    """Token lists for `inputs`, each within the model's context (cut when `truncate`), refused
    (400) as soon as their running total passes `max_tokens` (settings.max_embed_tokens): the
    texts after that point are never tokenized and nothing is embedded. Long texts are tokenized
    in a worker thread so the event loop keeps serving."""
    chars = sum(len(item) for item in inputs if isinstance(item, str))
    return await off_loop_stoppable(chars, _embed_tokens, engine, inputs, truncate, param, max_tokens)


async def off_loop_stoppable(chars: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args, stop)` as off_loop_if_long runs it, `stop` a threading.Event (None inline) that
    is set when the caller is cancelled (client gone), for `work` to check between its items."""
    if chars <= LONG_PROMPT_CHARS:
        return work(*args, None)
    stop = threading.Event()
    try:
        return await asyncio.to_thread(work, *args, stop)
    finally:
        stop.set()  # a cancelled request (client gone) stops the thread before its next item


async def embed_texts(engine: ModelEngine, inputs: Sequence[str | list[int]], *, truncate: bool, param: str,
                      max_tokens: int, lane: Lane = "default") -> tuple[list[list[int]], list[list[float]]]:
    """(token lists, vectors) of one embeddings request. Cancelling the caller (a client that
    left: run it under guard_disconnect) stops both the tokenizing and the embedding."""
    token_lists = await embed_inputs(engine, inputs, truncate=truncate, param=param, max_tokens=max_tokens)
    return token_lists, await engine.embed(token_lists, lane=lane)


def _embed_tokens(engine: ModelEngine, inputs: Sequence[str | list[int]], truncate: bool, param: str,
                  max_tokens: int, stop: threading.Event | None) -> list[list[int]]:
    n_ctx = engine.n_ctx_per_seq
    n_vocab = engine.info.n_vocab
    out = []
    total = 0
    for item in inputs:
        if stop is not None and stop.is_set():
            raise ClientGone()
        tokens = tokenize_prompt(engine, item) if isinstance(item, str) else check_tokens(item, n_vocab, param)
        if not tokens:
            raise InvalidRequestError(f"'{param}' produced no tokens", param=param)
        if len(tokens) > n_ctx:
            if not truncate:
                raise ContextLengthExceededError(
                    f"an input has {len(tokens)} tokens; this model embeds at most {n_ctx}", param=param)
            tokens = tokens[:n_ctx]
        total += len(tokens)
        if total > max_tokens:
            raise InvalidRequestError(
                f"'{param}' holds more than {max_tokens} tokens in all; at most {max_tokens} per request "
                "(setting max_embed_tokens)", param=param)
        out.append(tokens)
    return out


async def submit_all(engine: ModelEngine, requests: Sequence[GenerationRequest]) -> list[EventStream]:
    """Submit every choice, or none: if the lane fills up halfway, the ones already queued are
    cancelled so a refused request leaves nothing behind."""
    streams: list[EventStream] = []
    try:
        for request in requests:
            streams.append(await engine.generate(request))
    except BaseException:
        cancel_all(streams)
        raise
    return streams


def cancel_all(streams: Sequence[EventStream]) -> None:
    for stream in streams:
        stream.cancel()


@dataclass
class Run:
    """A generation in flight: the pinned model's name and engine, its requests and their streams."""

    model: str
    engine: ModelEngine
    requests: list[GenerationRequest]
    streams: list[EventStream]


Prepare = Callable[[ModelEngine], Awaitable[list[GenerationRequest]]]


@asynccontextmanager
async def generation(manager: "ModelManager", model: str, keep_alive: float | None, prepare: Prepare,
                     clock: "Clock | None" = None, lane: Lane = "default",
                     images: "ImageParts | None" = None) -> AsyncIterator[Run]:
    """The one skeleton of every generating endpoint: lease `model` (loading it if needed, waiting
    in `lane` for a swap), let `prepare` turn the validated body into engine requests (template,
    tokenize, bounds), submit all or none, and cancel every stream when the caller is done,
    returned, failed or was cancelled (a client gone), so the engine frees their KV at its next
    step. A batch-lane generation a swap ended (runtime/swaps.py) raises SwapPreemptedError.
    The request's `images` are decoded, fetched and checked first: bad ones never cost a load."""
    if images is not None:
        await images.resolve()
    for attempt in range(2):
        async with manager.use(model, keep_alive=keep_alive, lane=lane) as lease:
            if clock is not None:
                clock.mark_loaded()
            requests = await prepare(lease.engine)
            try:
                streams = await submit_all(lease.engine, requests)
            except EngineCrashedError:
                # Its worker had died when these came (a moment before, the manager not yet told:
                # it hears from the worker's reader thread): none of them ran, so they go once
                # more, to the model loaded again. A crash under running requests ends those.
                if attempt or getattr(lease.engine, "alive", True):
                    raise
                log.info("%s: its engine had stopped; the request goes to the model loaded again", lease.name)
                continue
            lease.attach(streams)  # so a swap can end batch-lane work at a step boundary
            origin = ORIGIN.get()
            tracked: list[str] = []
            if origin is not None and origin.tracker is not None and requests:
                origin.lane = requests[0].lane  # the latency figures are kept per lane
                tracked = origin.tracker.track(origin, lease.name, lease.engine, streams)  # the dashboard's rows
            try:
                yield Run(lease.name, lease.engine, requests, streams)
            except RequestCancelledError:
                if lease.preempted:
                    raise SwapPreemptedError(lease.name) from None
                raise
            finally:
                cancel_all(streams)
                if tracked:
                    origin.tracker.untrack(tracked)
            return


def with_seed_offset(request: GenerationRequest, offset: int) -> GenerationRequest:
    """Choice i of an n>1 request: same prompt, its own seed, so seeded choices differ but repeat."""
    clone = copy.deepcopy(request)
    if clone.sampling.seed is not None:
        clone.sampling.seed = (clone.sampling.seed + offset) & 0xFFFFFFFF
    if offset:
        clone.request_id = f"{request.request_id}-{offset}"
    return clone


async def merge(streams: Sequence[EventStream]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Events of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: EventStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
            queue.put_nowait((index, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class Choice:
    """One choice collected to its end (non-streaming answers)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


def raise_if_failed(event: GenerationEvent) -> None:
    """The one place an engine's failure becomes an exception, for every answer shape: the typed
    error the engine finished the request with (a grammar dead end is the caller's 400, a failed
    decode a 500 with its message), or RequestCancelledError (503) when the server ended it."""
    if event.finish_reason == "error":
        raise event.error or GenerationError("generation failed")
    if event.finish_reason == "cancelled":
        if cancelled_by() == "dashboard":
            raise RequestCancelledError("the request was cancelled from the localserve dashboard")
        raise RequestCancelledError()


async def collect(streams: Sequence[EventStream]) -> list[Choice]:
    choices = [Choice() for _ in streams]
    parts: list[list[str]] = [[] for _ in streams]
    async for index, event in merge(streams):
        raise_if_failed(event)
        choice = choices[index]
        if event.text:
            parts[index].append(event.text)
        choice.token_ids.extend(event.token_ids)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.usage = event.usage
    for choice, texts in zip(choices, parts):
        choice.text = "".join(texts)
    return choices


@dataclass
class UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, those inside a think block

    @classmethod
    def of(cls, usages: Sequence[Usage | None], n: int) -> "UsageTotals":
        """Prompt tokens count once per prompt (choices i*n .. i*n+n-1 share prompt i), as OpenAI
        bills them; completion tokens count for every choice."""
        totals = cls()
        for i, usage in enumerate(usages):
            if usage is None:
                continue
            if i % n == 0:
                totals.prompt_tokens += usage.prompt_tokens
                totals.cached_tokens += usage.cached_tokens
            totals.completion_tokens += usage.completion_tokens
            totals.reasoning_tokens += usage.reasoning_tokens
        return totals

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }


class Clock:
    """Wall-clock marks of one request, for Ollama's durations and the latency histograms."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.loaded = self.start

    def mark_loaded(self) -> None:
        self.loaded = time.perf_counter()

    def since_start_ns(self) -> int:
        return int((time.perf_counter() - self.start) * 1e9)

    def load_ns(self) -> int:
        return int((self.loaded - self.start) * 1e9)
