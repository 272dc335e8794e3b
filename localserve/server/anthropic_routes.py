"""Anthropic's Messages routes: POST /v1/messages (Claude Code adds ?beta=true, which changes
nothing here) and POST /v1/messages/count_tokens. GET /v1/models answers in Anthropic's shape
when the request carries `anthropic-version` (errors.is_anthropic_request, asked by openai_routes).

Only HTTP lives here: reading the body, the named SSE events, pings while nothing else is sent,
and the connection watch (a client that leaves cancels its generation). Parsing, the engine work
and the message objects are api/anthropic.py's, shared with the Batch API. Errors take Anthropic's
shape by path (server/errors.py), after the 200 as an `error` event.
"""

from __future__ import annotations


from aiohttp import web

from ..api.anthropic import MessagesCall, count_tokens, create_message, message_stream, parse_messages
from ..api.anthropic_stream import PING
from ..api.errors import anthropic_exception_body, json_dumps
from ..api.generation import Run, raise_if_failed
from ..api.openai import ApiEnv, observe, start
from ..errors import LocalserveError
from .body import read_json
from .disconnect import guard_disconnect
from .streamed import run_stream
from .openai_routes import api_env
from .sse import event_frame, open_sse, send_event
from .state import METRICS_KEY

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    env = api_env(request)
    call = parse_messages(await read_json(request), env)
    if not call.stream:
        return web.json_response(await guard_disconnect(request, create_message(call, env)), dumps=json_dumps)
    async with start(call.chat, env) as run:
        return await _stream(request, env, call, run)


@routes.post("/v1/messages/count_tokens")
async def messages_count_tokens(request: web.Request) -> web.Response:
    env = api_env(request)
    call = parse_messages(await read_json(request), env, count_only=True)
    return web.json_response(await guard_disconnect(request, count_tokens(call, env)), dumps=json_dumps)


async def _stream(request: web.Request, env: ApiEnv, call: MessagesCall, run: Run) -> web.StreamResponse:
    out = open_sse(request, keepalive=lambda: event_frame(*PING))
    stream = message_stream(call, run)
    timer = request.app[METRICS_KEY].token_timer(run.model)

    async def body() -> None:
        for name, data in stream.start():
            await out.hold(event_frame(name, data))
        async for event in run.streams[0]:
            raise_if_failed(event)
            timer.tokens(len(event.token_ids))
            for name, data in stream.feed(event):
                await send_event(out, name, data)
            if event.finish_reason is not None:
                observe(env, run.model, [event.usage])

    async def send_error(e: LocalserveError) -> None:  # the stream's last event, as Anthropic ends one
        await send_event(out, "error", anthropic_exception_body(e, f"stream of {request.path}")[1])

    return await run_stream(out, body(), send_error, request.path)
