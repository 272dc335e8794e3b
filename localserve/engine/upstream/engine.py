"""RemoteEngine: a model served by upstreams, behind the ModelEngine protocol (a TextEngine).

The upstream templates, tokenizes, batches and samples; this engine queues each request in our
lanes (pool.py) until an upstream has a slot, forwards the client's own fields, and turns the
upstream's SSE chunks back into GenerationEvents one by one, so the server's routes stream, collect
and count a remote model exactly as a local one. It always asks the upstream for a stream (with
usage): then a request that has not produced its first event yet can move to another upstream,
cancelling ours closes the upstream connection (the upstream frees its sequence), and `usage`
comes back either way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, TypeVar

from ...protocol.engine import EngineStats, ModelInfo
from ...errors import InvalidRequestError, LocalserveError, UpstreamError
from ...protocol.requests import LANE_RANK, GenerationEvent, GenerationRequest, Lane, TokenLogprob, Usage
from .http import UpstreamFailed, clean, json_body, post, sse_events
from .pool import Upstream, UpstreamPool

T = TypeVar("T")
_END = object()


async def remote_engine(pool: UpstreamPool, model: str) -> "RemoteEngine | None":
    """The engine of a model some upstream serves (one per name, kept in the pool), or None."""
    if not pool.candidates(model) and any(u.config.exposes_all for u in pool.upstreams.values()):
        await pool.refresh_lists()  # an 'all models' upstream may have gained it since its last list
    if not pool.candidates(model):
        return None
    engine = pool.engines.get(model)
    if not isinstance(engine, RemoteEngine):
        engine = RemoteEngine(model, pool)
        pool.engines[model] = engine
    return engine


class RemoteEngine:
    def __init__(self, name: str, pool: UpstreamPool):
        self.name = name
        self.pool = pool
        self._streams: set[RemoteStream] = set()
        self._info = ModelInfo(name=name, architecture="remote", n_ctx_train=0, n_vocab=0, n_embd=0, n_params=0,
                               chat_template=None, bos_token=None, eos_token=None, metadata={"remote": True})

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx_per_seq(self) -> int:
        return 0  # the upstream's to say; it refuses (400) what does not fit

    def upstream_names(self) -> list[str]:
        return [u.name for u, _ in self.pool.candidates(self.name)]

    def _refuse(self) -> InvalidRequestError:
        return InvalidRequestError(f"model {self.name} is served by upstream {', '.join(self.upstream_names())}: "
                                   "use the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings)")

    async def generate(self, request: GenerationRequest) -> "RemoteStream":
        if request.text is None:
            raise self._refuse()
        self.pool.check_queue(self.name, request.lane, self.pool.waiting(self.name))
        stream = RemoteStream(self, request)
        self._streams.add(stream)
        stream.start()
        return stream

    async def embed(self, inputs: list[list[int]], lane: Lane = "default") -> list[list[float]]:
        return (await self.embed_text(list(inputs)))[0]

    async def rank(self, inputs: list[list[int]], lane: Lane = "default") -> list[float]:
        raise InvalidRequestError(f"model {self.name} is served by upstream {', '.join(self.upstream_names())}, "
                                  "which this server does not rerank with", param="model")

    async def embed_text(self, inputs: list[str | list[int]],
                         dimensions: int | None = None) -> tuple[list[list[float]], int]:
        body: dict[str, Any] = {"input": inputs, "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions

        async def call(upstream: Upstream, remote_id: str) -> tuple[list[list[float]], int]:
            async with post(self.pool, upstream, "/embeddings", {**body, "model": remote_id}) as response:
                data = await json_body(self.pool, upstream, response)
            try:
                rows = sorted(data["data"], key=lambda d: d["index"])
                vectors = [[float(x) for x in row["embedding"]] for row in rows]
                tokens = int((data.get("usage") or {}).get("prompt_tokens") or 0)
            except (KeyError, TypeError, ValueError):
                raise UpstreamError(f"upstream {upstream.name} sent embeddings in an unexpected shape") from None
            if len(vectors) != len(inputs):
                raise UpstreamError(f"upstream {upstream.name} sent {len(vectors)} embeddings for {len(inputs)} inputs")
            return vectors, tokens

        return await self.on_upstream("default", call)

    async def on_upstream(self, lane: str, call: Callable[[Upstream, str], Awaitable[T]],
                          started: Callable[[], bool] = lambda: False) -> T:
        """Run `call` with a slot on one of the model's upstreams. An upstream that cannot answer is
        taken out and, while nothing has reached the client yet, the next one is tried."""
        tried: set[str] = set()
        while True:
            upstream, remote_id = await self.pool.acquire(self.name, lane, tried)
            try:
                result = await call(upstream, remote_id)
                upstream.served += 1
                return result
            except UpstreamFailed as e:
                self.pool.mark_failed(upstream, e.reason)
                if started():
                    raise UpstreamError(f"upstream {upstream.name} failed mid-answer ({e.reason})") from None
                tried.add(upstream.name)
            finally:
                self.pool.release(upstream)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        raise self._refuse()

    def detokenize(self, tokens: list[int]) -> str:
        raise self._refuse()

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        raise self._refuse()

    def stats(self) -> EngineStats:
        running = sum(1 for s in self._streams if s.running)
        return EngineStats(running=running, waiting=self.pool.waiting(self.name), kv_used=0, kv_total=0,
                           tokens_per_s=0.0, prompt_tokens_per_s=0.0, prefix_cache_hits=0, prefix_cache_queries=0,
                           prefix_cache_hit_rate=0.0, steps=0, busy=bool(self._streams))

    def cancel_all(self) -> None:
        for stream in list(self._streams):
            stream.cancel()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.cancel_all()


class RemoteStream:
    """One request's events from the upstream. A failure before the first event is raised from
    __anext__ as our error (so a non-streamed answer gets its proper status); after it, it ends
    the stream with finish_reason "error" and a safe message."""

    def __init__(self, engine: RemoteEngine, request: GenerationRequest):
        self.engine = engine
        self.request = request
        self.running = False
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._delivered = False
        self._finished = False
        self._start = time.perf_counter()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"upstream {self.request_id}")

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, LocalserveError):
            self._finished = True
            raise item
        if item.finish_reason is not None:
            self._queue.put_nowait(_END)
        return item

    def _put(self, event: GenerationEvent) -> None:
        self._delivered = True
        self._queue.put_nowait(event)

    def _fail(self, error: LocalserveError) -> None:
        if self._delivered:
            self._queue.put_nowait(GenerationEvent(finish_reason="error", error=error))
        else:
            self._queue.put_nowait(error)

    async def _run(self) -> None:
        try:
            await self.engine.on_upstream(self.request.lane, self._forward, lambda: self._delivered)
        except asyncio.CancelledError:
            self._queue.put_nowait(GenerationEvent(finish_reason="cancelled", usage=self._usage(None, 0.0)))
        except LocalserveError as e:
            self._fail(e)
        finally:
            self.running = False
            self.engine._streams.discard(self)

    async def _forward(self, upstream: Upstream, remote_id: str) -> None:
        queued = time.perf_counter() - self._start
        self.running = True
        text = self.request.text
        assert text is not None
        body: dict[str, Any] = {**text.options, "model": remote_id, "stream": True,
                                "stream_options": {"include_usage": True}}
        if text.kind == "chat":
            body["messages"] = text.messages
        else:
            body["prompt"] = text.prompt
        if self.request.sampling.seed is not None:
            body["seed"] = self.request.sampling.seed  # choice i of n carries its own seed
        if upstream.config.priority_field:
            body[upstream.config.priority_field] = LANE_RANK[self.request.lane]
        path = "/chat/completions" if text.kind == "chat" else "/completions"
        reason, usage, ttft = None, None, 0.0
        async with post(self.engine.pool, upstream, path, body) as response:
            async for chunk in sse_events(self.engine.pool, upstream, response):
                if "error" in chunk:
                    raise UpstreamError(f"upstream {upstream.name}: {clean(upstream, _error_text(chunk))}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    event = _event_of(choice, text.kind)
                    if event.text or event.logprobs:
                        ttft = ttft or time.perf_counter() - self._start
                        self._put(event)
                    reason = choice.get("finish_reason") or reason
        if reason is None:
            raise UpstreamError(f"upstream {upstream.name} ended the answer without a finish reason")
        self._put(GenerationEvent(finish_reason="length" if reason == "length" else "stop",
                                  usage=self._usage(usage, queued, ttft)))

    def _usage(self, usage: dict[str, Any] | None, queued: float, ttft: float = 0.0) -> Usage:
        usage = usage if isinstance(usage, dict) else {}
        details = usage.get("prompt_tokens_details") or {}
        return Usage(prompt_tokens=_int(usage.get("prompt_tokens")), completion_tokens=_int(usage.get("completion_tokens")),
                     cached_tokens=_int(details.get("cached_tokens") if isinstance(details, dict) else 0),
                     queue_s=queued, ttft_s=ttft, total_s=time.perf_counter() - self._start)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _error_text(chunk: dict[str, Any]) -> str:
    err = chunk.get("error")
    return str(err.get("message", "")) if isinstance(err, dict) else str(err)


def _event_of(choice: dict[str, Any], kind: str) -> GenerationEvent:
    if kind == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
        lps = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        logprobs = [TokenLogprob(-1, str(lp.get("token", "")), float(lp.get("logprob", 0.0)),
                                 [(-1, str(t.get("token", "")), float(t.get("logprob", 0.0)))
                                  for t in lp.get("top_logprobs") or []])
                    for lp in lps or [] if isinstance(lp, dict)] or None
    else:
        text = choice.get("text")
        raw = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
        tops = raw.get("top_logprobs") or []
        logprobs = [TokenLogprob(-1, str(tok), float(lp if lp is not None else 0.0),
                                 [(-1, str(t), float(v)) for t, v in (tops[i] or {}).items()] if i < len(tops) else [])
                    for i, (tok, lp) in enumerate(zip(raw.get("tokens") or [], raw.get("token_logprobs") or []))] or None
    return GenerationEvent(text=text if isinstance(text, str) else "", logprobs=logprobs)


