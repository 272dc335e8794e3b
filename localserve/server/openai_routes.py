"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

Shapes follow OpenAI's API reference (chat.completion / chat.completion.chunk / text_completion,
SSE `data: {...}` frames ending in `data: [DONE]`, usage with prompt_tokens_details.cached_tokens,
logprobs as {"content": [{token, logprob, bytes, top_logprobs}]} for chat and the legacy
{tokens, token_logprobs, top_logprobs, text_offset} for completions), so the official `openai`
package and editor plugins built on it work unchanged.

These handlers hold only what is HTTP: reading the body, the X-Priority header, SSE, and watching
the connection (guard_disconnect). Parsing, the engine work and the response objects are
api/openai.py's, shared with callers that have no HTTP request (the Batch API).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..protocol.engine import EventStream
from ..errors import InvalidNameError, LocalserveError, ModelNotFoundError
from ..protocol.requests import Usage
from ..api.errors import json_dumps, openai_exception_body
from ..api.generation import UsageTotals, merge, raise_if_failed
from ..api.anthropic import model_info as anthropic_model_info, model_list as anthropic_model_list
from .disconnect import guard_disconnect
from .held import HeldStream
from .streamed import run_stream
from .errors import is_anthropic_request
from .sse import DONE, data_frame, open_sse, send_sse
from ..api.openai import ApiEnv, Options, chat_completion, completion, observe, parse_chat, parse_completion, start
from ..api.openai_embeddings import embeddings, parse_embeddings
from ..api.openai_shapes import CHAT_PREFIX, COMPLETION_PREFIX, Head, chat_logprobs, completion_logprobs, finish_reason
from ..store.projector import kinds
from .state import MANAGER_KEY, METRICS_KEY, SETTINGS_KEY, STORE_KEY
from ..api.reasoning import Thoughts
from ..api.tools import ToolCallStream
from .body import read_json

routes = web.RouteTableDef()


def api_env(request: web.Request) -> ApiEnv:
    app = request.app
    return ApiEnv(app[SETTINGS_KEY], app[MANAGER_KEY], app[METRICS_KEY], request.headers.get("X-Priority"))


# --- chat and completions ------------------------------------------------------------------------
@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    env = api_env(request)
    call = parse_chat(await read_json(request), env)
    if not call.opts.stream:
        return web.json_response(await guard_disconnect(request, chat_completion(call, env)), dumps=json_dumps)
    async with start(call, env) as run:
        reply = _Reply(request, env, Head(run.model, CHAT_PREFIX), call.opts, call.tools, call.think_inside)
        return await reply.stream_chat(run.streams)


@routes.post("/v1/completions")
@routes.post("/v1/fim/completions")  # Continue's OpenAI provider posts FIM here ({apiBase}/fim/completions)
@routes.post("/fim/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    env = api_env(request)
    call = parse_completion(await read_json(request), env)
    if not call.opts.stream:
        return web.json_response(await guard_disconnect(request, completion(call, env)), dumps=json_dumps)
    async with start(call, env) as run:
        reply = _Reply(request, env, Head(run.model, COMPLETION_PREFIX), call.opts, [])
        return await reply.stream_completion(run.streams, call.echoes)


class _Reply:
    """SSE writing shared by the streamed chat and completion handlers."""

    def __init__(self, request: web.Request, env: ApiEnv, head: Head, opts: Options, tools: list[dict],
                 think_inside: bool | None = None):
        self.request = request
        self.env = env
        self.head = head
        self.model = head.model
        self.id = head.id
        self.opts = opts
        self.tools = tools
        self.think_inside = think_inside  # the thinking apart in reasoning_content (openai.ChatCall)
        self.metrics = request.app[METRICS_KEY]
        self.obj = "chat.completion.chunk" if head.prefix == CHAT_PREFIX else "text_completion"
        self.open_choices: list[int] = []  # the choices whose finish_reason has not been sent

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        data = {**self.head.of(self.obj), "choices": choices}
        if self.opts.include_usage:
            data["usage"] = None  # as OpenAI: null on every chunk but the last
        return data

    def empty_choice(self, i: int, reason: str | None) -> dict[str, Any]:
        """Choice `i` saying nothing: a keepalive (no reason) or its end."""
        if self.obj == "text_completion":
            return {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
        return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}

    async def end_choice(self, out: HeldStream, i: int, reason: str) -> None:
        self.open_choices.remove(i)
        await send_sse(out, self.chunk([self.empty_choice(i, reason)]))

    def keepalive(self) -> bytes:
        # A chunk with nothing in it, where a comment would do for the SSE parser: clients guard
        # against an idle stream above their SDK, which drops comments (Qwen Code's 240 s guard).
        return data_frame(self.chunk([self.empty_choice(self.open_choices[0] if self.open_choices else 0, None)]))

    async def run_stream(self, streams: list[EventStream],
                         body_writer: Callable[[HeldStream, list[EventStream]], Awaitable[None]]) -> web.StreamResponse:
        out = open_sse(self.request, self.keepalive)
        self.open_choices = list(range(len(streams)))

        async def send_error(e: LocalserveError) -> None:
            # OpenAI's clients raise on a frame with an "error" member: a failure mid-stream (an
            # engine's typed failure, a remote upstream's 400) in the body a non-streamed request gets.
            # Clients that read only the choices wait for a finish_reason (Mistral Vibe: "stream ended
            # without a finish reason"): "error", as OpenRouter ends a failed stream.
            await send_sse(out, openai_exception_body(e, f"stream of {self.id}"))
            for i in list(self.open_choices):
                await self.end_choice(out, i, "error")
            await out.write(DONE)

        return await run_stream(out, body_writer(out, streams), send_error, self.id)

    async def finish_stream(self, out: HeldStream, usages: list[Usage | None]) -> None:
        observe(self.env, self.model, usages)
        if self.opts.include_usage:
            await send_sse(out, {**self.head.of(self.obj), "choices": [],
                                 "usage": UsageTotals.of(usages, self.opts.n).openai()})
        await out.write(DONE)

    async def stream_chat(self, streams: list[EventStream]) -> web.StreamResponse:
        return await self.run_stream(streams, self._chat_body)

    async def _chat_body(self, out: HeldStream, streams: list[EventStream]) -> None:
        k = self.opts.logprobs
        filters = [ToolCallStream(self.tools) if self.tools else None for _ in streams]
        thoughts = [Thoughts(self.think_inside) for _ in streams]
        usages: list[Usage | None] = [None] * len(streams)
        timer = self.metrics.token_timer(self.model)
        for i in range(len(streams)):
            await out.hold(data_frame(self.chunk([
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])))
        async for i, event in merge(streams):
            raise_if_failed(event)
            timer.tokens(len(event.token_ids))
            thinking, text = thoughts[i].feed(event.text, last=event.finish_reason is not None)
            text = filters[i].feed(text) if filters[i] else text
            lps = chat_logprobs(event.logprobs, k) if k is not None and event.logprobs else None
            if thinking:  # llama-server's delta for it: reasoning_content alone
                await send_sse(out, self.chunk([
                    {"index": i, "delta": {"reasoning_content": thinking}, "logprobs": None, "finish_reason": None}]))
            if text or lps:
                await send_sse(out, self.chunk([
                    {"index": i, "delta": {"content": text}, "logprobs": lps, "finish_reason": None}]))
            if event.finish_reason is None:
                continue
            reason = finish_reason(event.finish_reason)
            if filters[i]:
                rest, calls = filters[i].finish()
                delta: dict[str, Any] = {}
                if rest:
                    delta["content"] = rest
                if calls:
                    delta["tool_calls"] = [c.openai(index=j) for j, c in enumerate(calls)]
                    reason = "tool_calls"
                if delta:
                    await send_sse(out, self.chunk([
                        {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
            await self.end_choice(out, i, reason)
            usages[i] = event.usage
        await self.finish_stream(out, usages)

    async def stream_completion(self, streams: list[EventStream], echo: list[str]) -> web.StreamResponse:
        async def body(out: HeldStream, streams: list[EventStream]) -> None:
            k, n = self.opts.logprobs, self.opts.n
            usages: list[Usage | None] = [None] * len(streams)
            offsets = [len(echo[i // n]) for i in range(len(streams))]
            timer = self.metrics.token_timer(self.model)
            for i in range(len(streams)):
                if echo[i // n]:
                    await out.hold(data_frame(self.chunk([
                        {"index": i, "text": echo[i // n], "logprobs": None, "finish_reason": None}])))
            async for i, event in merge(streams):
                raise_if_failed(event)
                timer.tokens(len(event.token_ids))
                lps = None
                if k is not None and event.logprobs:
                    lps = completion_logprobs(event.logprobs, k, offsets[i])
                    offsets[i] += sum(len(lp.text) for lp in event.logprobs)
                if event.text or lps:
                    await send_sse(out, self.chunk([
                        {"index": i, "text": event.text, "logprobs": lps, "finish_reason": None}]))
                if event.finish_reason:
                    # Its own chunk with empty text, as llama-server sends it: clients that read
                    # text only while finish_reason is null lose no token.
                    await self.end_choice(out, i, finish_reason(event.finish_reason))
                    usages[i] = event.usage
            await self.finish_stream(out, usages)

        return await self.run_stream(streams, body)


# --- embeddings ----------------------------------------------------------------------------------
@routes.post("/v1/embeddings")
async def create_embeddings(request: web.Request) -> web.Response:
    env = api_env(request)
    call = parse_embeddings(await read_json(request), env)
    return web.json_response(await guard_disconnect(request, embeddings(call, env)), dumps=json_dumps)


# --- models --------------------------------------------------------------------------------------
def model_entry(model: Any) -> dict[str, Any]:
    """An installed model; `vision` / `audio`: its projector in the store takes images / audio
    (once loaded; store/projector.py `kinds`)."""
    takes = kinds(model.mmproj)
    return {"id": model.ref, "object": "model", "created": int(model.modified), "owned_by": "localserve",
            "vision": "vision" in takes, "audio": "audio" in takes}


def remote_entry(name: str, upstreams: list[str]) -> dict[str, Any]:
    """A model an upstream serves: owned_by names the upstream(s), `remote` marks it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "remote:" + ",".join(upstreams),
            "remote": True}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    models = await asyncio.to_thread(request.app[STORE_KEY].list)
    data = [model_entry(m) for m in models]
    pool = request.app[MANAGER_KEY].upstreams
    if pool is not None:
        local = {m.ref for m in models}
        data += [remote_entry(name, ups) for name, ups in pool.models().items() if name not in local]
    if is_anthropic_request(request):  # the anthropic SDK's models.list()
        return web.json_response(anthropic_model_list(data))
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    try:
        model = await asyncio.to_thread(request.app[STORE_KEY].find, name)
    except (ModelNotFoundError, InvalidNameError):
        pool = request.app[MANAGER_KEY].upstreams
        upstreams = pool.models().get(name) if pool is not None else None
        if not upstreams:
            raise
        entry = remote_entry(name, upstreams)
    else:
        entry = model_entry(model)
    return web.json_response(anthropic_model_info(entry) if is_anthropic_request(request) else entry)
