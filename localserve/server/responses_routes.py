"""OpenAI Responses routes: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

Only what is HTTP lives here: reading the body, SSE with `event:` lines (the Responses stream
names each event, as OpenAI sends it), and the connection watch (guard_disconnect: a client that
leaves cancels its generation). Parsing, the conversation, the response objects, the events and
the stored responses are api/responses*.py's, shared with the Batch API.
"""

from __future__ import annotations


from aiohttp import web

from ..api.errors import json_dumps
from ..api.generation import Run, merge, raise_if_failed
from ..api.openai import ApiEnv, observe
from ..api.responses import (
    Conversation,
    conversation,
    create_response,
    delete_response,
    get_response,
    input_items,
    keep,
    parse_responses,
    start,
)
from ..api.responses_stream import Event, ResponseEvents
from ..api.validation import Body
from ..errors import LocalserveError
from .body import read_json
from .disconnect import guard_disconnect
from .held import HeldStream
from .streamed import run_stream
from .openai_routes import api_env
from .sse import event_frame, open_sse
from .state import METRICS_KEY

routes = web.RouteTableDef()


@routes.post("/v1/responses")
async def create(request: web.Request) -> web.StreamResponse:
    env = api_env(request)
    call = parse_responses(await read_json(request), env)
    if not call.chat.opts.stream:
        return web.json_response(await guard_disconnect(request, create_response(call, env)), dumps=json_dumps)
    conv = await guard_disconnect(request, conversation(call, env))  # an unknown previous id: a 404, not a stream
    async with start(conv, env) as run:
        return await _stream(request, env, conv, run)


async def _stream(request: web.Request, env: ApiEnv, conv: Conversation, run: Run) -> web.StreamResponse:
    events = ResponseEvents(conv, run.model, run.engine)
    # Codex and the SDKs see progress only in events (comments are dropped): the lifecycle event
    # that says "still working" is the keepalive.
    out = open_sse(request, keepalive=lambda: _frames([events.still_working()]))

    async def send_error(e: LocalserveError) -> None:
        await out.write(_frames(events.failure(e)))

    return await run_stream(out, _write_events(request, out, env, events, run), send_error, conv.call.id)


async def _write_events(request: web.Request, out: HeldStream, env: ApiEnv, events: ResponseEvents,
                        run: Run) -> None:
    timer = request.app[METRICS_KEY].token_timer(run.model)
    await out.hold(_frames(events.opening()))
    async for _, event in merge(run.streams):
        raise_if_failed(event)
        timer.tokens(len(event.token_ids))
        await _send(out, events.feed(event))
        if event.finish_reason is not None:
            closing, final = events.finish(event)
            observe(env, run.model, [event.usage])
            await keep(events.conv, final, env)  # stored before the client hears it is done
            await _send(out, closing)


def _frames(events: list[Event]) -> bytes:
    return b"".join(event_frame(e["type"], e) for e in events)


async def _send(out: HeldStream, events: list[Event]) -> None:
    if events:
        await out.write(_frames(events))


@routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(await get_response(api_env(request), request.match_info["response_id"]),
                             dumps=json_dumps)


@routes.delete("/v1/responses/{response_id}")
async def delete(request: web.Request) -> web.Response:
    return web.json_response(await delete_response(api_env(request), request.match_info["response_id"]))


@routes.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: web.Request) -> web.Response:
    query = Body(dict(request.query))
    if "limit" in request.query:
        query.data["limit"] = _int(request.query["limit"])
    return web.json_response(await input_items(api_env(request), request.match_info["response_id"], query),
                             dumps=json_dumps)


def _int(text: str) -> int | str:
    """A query string's number as a number (the Body check then says what is wrong with it)."""
    try:
        return int(text)
    except ValueError:
        return text
