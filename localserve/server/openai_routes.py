"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

Shapes follow OpenAI's API reference (chat.completion / chat.completion.chunk / text_completion,
SSE `data: {...}` frames ending in `data: [DONE]`, usage with prompt_tokens_details.cached_tokens,
logprobs as {"content": [{token, logprob, bytes, top_logprobs}]} for chat and the legacy
{tokens, token_logprobs, top_logprobs, text_offset} for completions), so the official `openai`
package and editor plugins built on it work unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import web

from .. import __version__
from ..requests import GenerationEvent, GenerationRequest, Lane, TokenLogprob
from ..schema_bounds import check_schema
from .errors import ClientGone, json_dumps, openai_error_body
from .generation import (
    UsageTotals,
    cancel_all,
    chat_template,
    check_tokens,
    collect,
    embed_request,
    guard_disconnect,
    is_token_list,
    merge,
    submit_all,
    tokenize_async,
    with_seed_offset,
)
from .state import MANAGER_KEY, METRICS_KEY, SETTINGS_KEY, STORE_KEY
from .tools import ToolCallStream, forced_call_schema, parse_tool_calls
from .validation import (
    MAX_EMBED_INPUTS,
    MAX_LOGPROBS,
    MAX_PROMPTS,
    Body,
    clamp_max_tokens,
    invalid,
    parse_json_format,
    parse_keep_alive,
    parse_lane,
    parse_logit_bias,
    parse_messages,
    parse_n,
    parse_seed,
    parse_stop,
    parse_tool_choice,
    parse_tools,
    read_json,
    sampling_from,
)

routes = web.RouteTableDef()
log = logging.getLogger("localserve.server")

SYSTEM_FINGERPRINT = f"localserve-{__version__}"
MAX_TOKENS_LIMIT = (1 << 63) - 1  # bigger asks are clamped to the context left, not refused
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a number


# --- request parsing -----------------------------------------------------------------------------
@dataclass
class Options:
    model: str
    stream: bool
    include_usage: bool
    n: int
    stop: list[str]
    max_tokens: int | None
    seed: int | None
    logprobs: int | None  # None = off, k = chosen token + k alternatives
    json_schema: dict | None
    lane: Lane
    keep_alive: float | None


def parse_options(body: Body, request: web.Request, *, chat: bool) -> Options:
    settings = request.app[SETTINGS_KEY]
    stream = body.get_bool("stream", False)
    stream_options = body.get_object("stream_options")
    if stream_options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if chat:
        max_tokens = body.get_int("max_completion_tokens", None, lo=1, hi=MAX_TOKENS_LIMIT)
        if max_tokens is None:
            max_tokens = body.get_int("max_tokens", None, lo=1, hi=MAX_TOKENS_LIMIT)
        want = body.get_bool("logprobs", False)
        top = body.get_int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want:
            raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        max_tokens = body.get_int("max_tokens", 16, lo=1, hi=MAX_TOKENS_LIMIT)  # OpenAI's default for completions
        logprobs = body.get_int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    return Options(
        model=body.get_str("model", None, max_len=512) or settings.default_model,
        stream=stream,
        include_usage=stream_options.get_bool("include_usage", False) if stream_options else False,
        n=parse_n(body),
        stop=parse_stop(body.raw("stop")),
        max_tokens=max_tokens,
        seed=parse_seed(body),
        logprobs=logprobs,
        json_schema=parse_json_format(body.raw("response_format"), "response_format"),
        lane=parse_lane(body, request, "interactive" if (chat and stream) else "default"),
        keep_alive=parse_keep_alive(body.raw("keep_alive")),
    )


def build_request(body: Body, opts: Options, engine: Any, tokens: list[int], *, param: str) -> GenerationRequest:
    n_vocab = engine.backend.info.n_vocab
    sampling = sampling_from(body, n_vocab=n_vocab, seed=opts.seed)
    sampling.logit_bias = parse_logit_bias(body.raw("logit_bias"), n_vocab)
    sampling.json_schema = opts.json_schema
    sampling.logprobs = opts.logprobs
    return GenerationRequest(
        prompt_tokens=tokens,
        sampling=sampling,
        max_tokens=clamp_max_tokens(opts.max_tokens, len(tokens), engine.n_ctx_per_seq, param),
        stop=opts.stop,
        lane=opts.lane,
    )


def finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def chat_logprobs(items: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.text,
                "logprob": _lp(lp.logprob),
                "bytes": list(lp.text.encode("utf-8")),
                "top_logprobs": [
                    {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}
                    for _, text, value in lp.top[:k]
                ],
            }
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[TokenLogprob], k: int, offset: int) -> dict[str, Any]:
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.text)
    return {
        "tokens": [lp.text for lp in items],
        "token_logprobs": [_lp(lp.logprob) for lp in items],
        "top_logprobs": [{text: _lp(value) for _, text, value in lp.top[:k]} for lp in items],
        "text_offset": offsets,
    }


# --- SSE -----------------------------------------------------------------------------------------
async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, data: Any) -> None:
    await response.write(f"data: {json_dumps(data)}\n\n".encode("utf-8"))


async def send_sse_error(response: web.StreamResponse, message: str) -> None:
    # After the 200 and the first chunks no status can change: OpenAI's clients raise on a frame
    # with an "error" member, so that is how a failure mid-stream is told.
    await send_sse(response, openai_error_body(message, "server_error", None, "generation_failed"))


class StreamFailed(Exception):
    pass


def check_event(event: GenerationEvent) -> None:
    if event.finish_reason in ("error", "cancelled"):
        raise StreamFailed(event.error or "the request was cancelled by the server")


# --- chat ----------------------------------------------------------------------------------------
@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    opts = parse_options(body, request, chat=True)
    messages = parse_messages(body.raw("messages"))
    tools = parse_tools(body.raw("tools"))
    tool_choice = parse_tool_choice(body.raw("tool_choice"), tools)
    active_tools = [] if tool_choice == "none" else tools
    forced = tools if tool_choice == "required" else [tool_choice] if isinstance(tool_choice, dict) else None
    if forced and opts.json_schema is not None:
        raise invalid("'response_format' cannot be combined with a forced 'tool_choice'", "response_format")
    if forced:
        check_schema(forced_call_schema(forced), "tools")  # refused before any model load
    sampling_from(body, n_vocab=1 << 20, seed=None)  # fail fast on bad sampling fields, before any model load

    async with request.app[MANAGER_KEY].use(opts.model, keep_alive=opts.keep_alive) as loaded:
        engine = loaded.engine
        template = chat_template(engine)
        prompt = await template.render_async(messages, tools=active_tools or None)
        tokens = await tokenize_async(engine, prompt, template)
        base = build_request(body, opts, engine, tokens, param="messages")
        if forced:
            base.sampling.json_schema = forced_call_schema(forced)
            base.sampling.constraint_param = "tools"
        streams = await submit_all(engine, [with_seed_offset(base, i) for i in range(opts.n)])
        ctx = _Reply(request, loaded.name, opts, active_tools, prefix="chatcmpl")
        try:
            if opts.stream:
                return await ctx.stream_chat(streams)
            choices = await guard_disconnect(request, collect(streams))
        finally:
            cancel_all(streams)

    out = []
    for i, choice in enumerate(choices):
        content, calls = parse_tool_calls(choice.text, active_tools) if active_tools else (choice.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        out.append({
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(choice.logprobs, opts.logprobs) if opts.logprobs is not None else None,
            "finish_reason": "tool_calls" if calls else finish_reason(choice.finish_reason),
        })
    ctx.observe([c.usage for c in choices])
    return web.json_response({
        **ctx.head("chat.completion"),
        "choices": out,
        "usage": UsageTotals.of([c.usage for c in choices], opts.n).openai(),
    }, dumps=json_dumps)


class _Reply:
    """Ids, timestamps and SSE writing shared by the chat and completion handlers."""

    def __init__(self, request: web.Request, model: str, opts: Options, tools: list[dict], *, prefix: str):
        self.request = request
        self.model = model
        self.opts = opts
        self.tools = tools
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.metrics = request.app[METRICS_KEY]

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def observe(self, usages: Sequence[Any]) -> None:
        for usage in usages:
            self.metrics.observe_usage(self.model, usage)

    def chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        data = {**self.head(obj), "choices": choices}
        if self.opts.include_usage:
            data["usage"] = None  # as OpenAI: null on every chunk but the last
        return data

    async def run_stream(self, streams: list[Any], body_writer: Any) -> web.StreamResponse:
        response = await open_sse(self.request)
        try:
            await guard_disconnect(self.request, body_writer(response, streams))
        except (ClientGone, ConnectionResetError):
            pass  # the client left; the caller's finally cancels the streams
        except Exception:  # noqa: BLE001 - headers are out: the error middleware can no longer answer
            log.exception("stream of %s failed", self.id)
            with contextlib.suppress(ConnectionResetError):
                await send_sse_error(response, "internal server error")
        return response

    async def finish_stream(self, response: web.StreamResponse, obj: str, usages: list[Any]) -> None:
        self.observe(usages)
        if self.opts.include_usage:
            await send_sse(response, {**self.head(obj), "choices": [],
                                      "usage": UsageTotals.of(usages, self.opts.n).openai()})
        await response.write(b"data: [DONE]\n\n")

    async def stream_chat(self, streams: list[Any]) -> web.StreamResponse:
        return await self.run_stream(streams, self._chat_body)

    async def _chat_body(self, response: web.StreamResponse, streams: list[Any]) -> None:
        obj, k = "chat.completion.chunk", self.opts.logprobs
        filters = [ToolCallStream(self.tools) if self.tools else None for _ in streams]
        usages: list[Any] = [None] * len(streams)
        timer = self.metrics.token_timer(self.model)
        for i in range(len(streams)):
            await send_sse(response, self.chunk(obj, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
        try:
            async for i, event in merge(streams):
                check_event(event)
                timer.tokens(len(event.token_ids))
                text = filters[i].feed(event.text) if filters[i] else event.text
                lps = chat_logprobs(event.logprobs, k) if k is not None and event.logprobs else None
                if text or lps:
                    await send_sse(response, self.chunk(obj, [
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
                        await send_sse(response, self.chunk(obj, [
                            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
                await send_sse(response, self.chunk(obj, [
                    {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]))
                usages[i] = event.usage
        except StreamFailed as e:
            await send_sse_error(response, str(e))
            return
        await self.finish_stream(response, obj, usages)

    async def stream_completion(self, streams: list[Any], echo: list[str]) -> web.StreamResponse:
        async def body(response: web.StreamResponse, streams: list[Any]) -> None:
            obj, k, n = "text_completion", self.opts.logprobs, self.opts.n
            usages: list[Any] = [None] * len(streams)
            offsets = [len(echo[i // n]) for i in range(len(streams))]
            timer = self.metrics.token_timer(self.model)
            for i in range(len(streams)):
                if echo[i // n]:
                    await send_sse(response, self.chunk(obj, [
                        {"index": i, "text": echo[i // n], "logprobs": None, "finish_reason": None}]))
            try:
                async for i, event in merge(streams):
                    check_event(event)
                    timer.tokens(len(event.token_ids))
                    lps = None
                    if k is not None and event.logprobs:
                        lps = completion_logprobs(event.logprobs, k, offsets[i])
                        offsets[i] += sum(len(lp.text) for lp in event.logprobs)
                    if event.text or lps:
                        await send_sse(response, self.chunk(obj, [
                            {"index": i, "text": event.text, "logprobs": lps, "finish_reason": None}]))
                    if event.finish_reason:
                        # Its own chunk with empty text, as llama-server sends it: clients that read
                        # text only while finish_reason is null lose no token.
                        await send_sse(response, self.chunk(obj, [{"index": i, "text": "", "logprobs": None,
                                                                    "finish_reason": finish_reason(event.finish_reason)}]))
                        usages[i] = event.usage
            except StreamFailed as e:
                await send_sse_error(response, str(e))
                return
            await self.finish_stream(response, obj, usages)

        return await self.run_stream(streams, body)


# --- completions ---------------------------------------------------------------------------------
def parse_text_or_tokens(value: Any, param: str, max_items: int) -> list[str | list[int]]:
    """OpenAI's prompt/input forms: a string, an array of strings, an array of token ids, or an
    array of token-id arrays -> one entry per text."""
    if isinstance(value, str) or is_token_list(value):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_token_list(p) for p in value):
        items = list(value)
    else:
        raise invalid(f"'{param}' must be a string, an array of strings, or token ids", param)
    if len(items) > max_items:
        raise invalid(f"'{param}' may hold at most {max_items} items", param)
    if any(isinstance(p, str) and not p for p in items):
        raise invalid(f"'{param}' must not contain empty strings", param)
    return items


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    opts = parse_options(body, request, chat=False)
    prompts = parse_text_or_tokens(body.raw("prompt"), "prompt", MAX_PROMPTS)
    if body.has("suffix"):
        raise invalid("'suffix' (fill-in-the-middle) is not supported", "suffix")
    best_of = body.get_int("best_of", None, lo=1, hi=opts.n)
    if best_of is not None and best_of != opts.n:
        raise invalid("'best_of' must equal 'n' (server-side ranking is not supported)", "best_of")
    echo = body.get_bool("echo", False)
    if echo and (opts.logprobs is not None or any(not isinstance(p, str) for p in prompts)):
        raise invalid("'echo' is supported with text prompts and without 'logprobs'", "echo")
    sampling_from(body, n_vocab=1 << 20, seed=None)

    async with request.app[MANAGER_KEY].use(opts.model, keep_alive=opts.keep_alive) as loaded:
        engine = loaded.engine
        requests = []
        for p in prompts:
            if isinstance(p, str):
                tokens = await tokenize_async(engine, p)
                if not tokens:
                    raise invalid("'prompt' is empty", "prompt")
            else:
                tokens = check_tokens(p, engine.backend.info.n_vocab, "prompt")
            base = build_request(body, opts, engine, tokens, param="prompt")
            requests.extend(with_seed_offset(base, i) for i in range(opts.n))
        echoes = [p if echo and isinstance(p, str) else "" for p in prompts]
        streams = await submit_all(engine, requests)
        ctx = _Reply(request, loaded.name, opts, [], prefix="cmpl")
        try:
            if opts.stream:
                return await ctx.stream_completion(streams, echoes)
            choices = await guard_disconnect(request, collect(streams))
        finally:
            cancel_all(streams)

    out = []
    for i, choice in enumerate(choices):
        prefix = echoes[i // opts.n]
        out.append({
            "index": i,
            "text": prefix + choice.text,
            "logprobs": completion_logprobs(choice.logprobs, opts.logprobs, 0) if opts.logprobs is not None else None,
            "finish_reason": finish_reason(choice.finish_reason),
        })
    ctx.observe([c.usage for c in choices])
    return web.json_response({
        **ctx.head("text_completion"),
        "choices": out,
        "usage": UsageTotals.of([c.usage for c in choices], opts.n).openai(),
    }, dumps=json_dumps)


# --- embeddings ----------------------------------------------------------------------------------
@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    settings = request.app[SETTINGS_KEY]
    model = body.get_str("model", None, max_len=512) or settings.default_model
    inputs = parse_text_or_tokens(body.raw("input"), "input", MAX_EMBED_INPUTS)
    encoding = body.get_str("encoding_format", "float", choices=("float", "base64"))
    dimensions = body.get_int("dimensions", None, lo=1, hi=1 << 20)
    async with request.app[MANAGER_KEY].use(model) as loaded:
        engine = loaded.engine
        n_embd = engine.backend.info.n_embd
        if dimensions is not None and dimensions != n_embd:
            raise invalid(f"'dimensions' must be {n_embd} for this model (no reduction supported)", "dimensions")
        token_lists, vectors = await embed_request(request, engine, inputs, truncate=False, param="input")
    n_tokens = sum(len(t) for t in token_lists)
    data = []
    for i, vector in enumerate(vectors):
        if encoding == "base64":
            # What the openai package asks for by default: little-endian float32, base64.
            encoded: Any = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        else:
            encoded = [float(x) for x in vector]
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    return web.json_response({
        "object": "list", "data": data, "model": loaded.name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }, dumps=json_dumps)


# --- models --------------------------------------------------------------------------------------
def model_entry(model: Any) -> dict[str, Any]:
    return {"id": model.ref, "object": "model", "created": int(model.modified), "owned_by": "localserve"}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    models = await asyncio.to_thread(request.app[STORE_KEY].list)
    return web.json_response({"object": "list", "data": [model_entry(m) for m in models]})


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    model = await asyncio.to_thread(request.app[STORE_KEY].find, request.match_info["model"])
    return web.json_response(model_entry(model))
