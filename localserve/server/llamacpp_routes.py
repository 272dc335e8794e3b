"""llama.cpp server's native routes: POST /infill (llama.vscode, llama.vim), POST /completion
(Continue's and Tabby's llama.cpp providers), streamed or not, GET /props, and the token routes
POST /tokenize, /detokenize (both also in vLLM's shape) and /apply-template (api/tokenizing.py), and
GET /lora-adapters (a model's LoRA adapters by id: api/lora.py)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from aiohttp import web

from .. import __version__
from ..api.errors import json_dumps, openai_exception_body
from ..api.generation import Run, generation, raise_if_failed
from ..api import tokenizing
from ..api.images import ImageParts
from ..api.llamacpp import (NativeCall, bounded, chunk_object, final_object, parse_infill, parse_native_completion,
                            props_body)
from ..errors import GenerationError, LocalserveError
from .body import read_json
from .disconnect import guard_disconnect
from .openai_routes import api_env
from .streamed import run_stream
from .served import lora_adapters, served
from .slots import Client, SlotClaim
from .sse import open_sse, send_sse
from .state import MANAGER_KEY, SETTINGS_KEY, SLOTS_KEY, STORE_KEY

routes = web.RouteTableDef()


@routes.post("/infill")
async def infill(request: web.Request) -> web.StreamResponse:
    return await _answer(request, parse_infill, "infill")


@routes.post("/completion")
async def native_completion(request: web.Request) -> web.StreamResponse:
    return await _answer(request, parse_native_completion, "completion")


@routes.get("/props")
async def props(request: web.Request) -> web.Response:
    """llama-server's router takes `?model=`; without it, the default model."""
    name = request.query.get("model") or request.app[SETTINGS_KEY].default_model
    model = await asyncio.to_thread(request.app[STORE_KEY].find, name)
    limits = await served(request, model)
    return web.json_response(props_body(model.ref, limits.context, limits.slots, __version__,
                                        request.app[SETTINGS_KEY].default_max_tokens, vision=limits.vision,
                                        audio=limits.audio),
                             dumps=json_dumps)


@routes.get("/lora-adapters")
async def list_lora_adapters(request: web.Request) -> web.Response:
    """llama-server's adapter list (id, path, scale), for `?model=` or the default model, as /props."""
    name = request.query.get("model") or request.app[SETTINGS_KEY].default_model
    model = await asyncio.to_thread(request.app[STORE_KEY].find, name)
    return web.json_response(lora_adapters(request, model), dumps=json_dumps)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    return await _tokens(request, tokenizing.tokenize)


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    return await _tokens(request, tokenizing.detokenize)


@routes.post("/apply-template")
async def apply_template(request: web.Request) -> web.Response:
    return await _tokens(request, tokenizing.apply_template)


async def _tokens(request: web.Request, answer: Callable[..., Awaitable[dict]]) -> web.Response:
    """A body answered with the model's tokenizer or template (no generation): a client that
    leaves cancels the tokenizing."""
    env = api_env(request)
    body = await read_json(request)
    return web.json_response(await guard_disconnect(request, answer(body, env)), dumps=json_dumps)


async def _answer(request: web.Request, parse: Callable[..., NativeCall], what: str) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    body = await read_json(request)
    call = parse(body, settings.default_model, request.headers.get("X-Priority"),
                 default_n_predict=settings.default_max_tokens, images=ImageParts.of(settings))
    async with request.app[SLOTS_KEY].claim(call.model, call.id_slot, _client(request)) as claim:
        async with generation(request.app[MANAGER_KEY], call.model, None, call.prepare, lane=call.lane,
                              images=call.images) as run:
            if call.stream:
                return await _stream(request, call, run, what, claim)
            final = await guard_disconnect(request, _collected(call, run), claim)
    return web.json_response(final, dumps=json_dumps)


def _client(request: web.Request) -> Client:
    """Who sent the request, for id_slot's superseding (server/slots.py): the User-Agent and both
    ends of the connection, as (host, port) (an IPv6 address comes with flow and scope ids)."""
    transport = request.transport

    def address(name: str) -> tuple[str, int] | None:
        value = transport.get_extra_info(name) if transport is not None else None
        return (value[0], value[1]) if isinstance(value, tuple) and len(value) >= 2 else None

    return Client(request.headers.get("User-Agent", ""), address("peername"), address("sockname"))


async def _collected(call: NativeCall, run: Run) -> dict:
    text: list[str] = []
    tokens: list[int] = []
    (stream,) = run.streams
    async for event in bounded(stream, call):
        raise_if_failed(event)
        text.append(event.text)
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            return final_object(call, run.model, "".join(text), tokens, event.usage, event.finish_reason)
    raise GenerationError("the engine's stream ended without a final event")


async def _stream(request: web.Request, call: NativeCall, run: Run, what: str,
                  claim: SlotClaim | None) -> web.StreamResponse:
    """`data: {"content": ..., "stop": false}` per piece of text, then the final object."""
    out = open_sse(request)  # comment pings, as llama-server sends (--sse-ping-interval)
    (stream,) = run.streams

    async def body() -> None:
        async for event in bounded(stream, call):
            raise_if_failed(event)
            if (event.text or event.token_ids) and call.n_predict != 0:
                await send_sse(out, chunk_object(call, event.text, event.token_ids))
            if event.finish_reason is not None:
                await send_sse(out, final_object(call, run.model, "", [], event.usage, event.finish_reason))

    async def send_error(e: LocalserveError) -> None:  # after the 200: the error object in a frame, as non-streamed
        await send_sse(out, openai_exception_body(e, f"{what} {run.model}"))

    # The client leaving is the next keystroke's request: generation() cancels the stream.
    return await run_stream(out, body(), send_error, f"{what} {run.model}", claim)
