"""llama.cpp server's native routes: POST /infill (llama.vscode, llama.vim), streamed or not."""

from __future__ import annotations

import contextlib

from aiohttp import web

from ..api.errors import ClientGone, json_dumps, openai_exception_body
from ..api.generation import Run, collect, generation, merge, raise_if_failed
from ..api.llamacpp import InfillCall, infill_final, parse_infill
from ..errors import LocalserveError
from .body import read_json
from .disconnect import guard_disconnect
from .sse import open_sse, send_sse
from .state import MANAGER_KEY, SETTINGS_KEY

routes = web.RouteTableDef()


@routes.post("/infill")
async def infill(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    call = parse_infill(body, request.app[SETTINGS_KEY].default_model, request.headers.get("X-Priority"))
    async with generation(request.app[MANAGER_KEY], call.model, None, call.prepare, lane=call.lane) as run:
        if call.stream:
            return await _stream(request, call, run)
        (choice,) = await guard_disconnect(request, collect(run.streams))
    return web.json_response(infill_final(call, run.model, choice.text, choice.usage, choice.finish_reason),
                             dumps=json_dumps)


async def _stream(request: web.Request, call: InfillCall, run: Run) -> web.StreamResponse:
    """`data: {"content": ..., "stop": false}` per piece of text, then the final object."""
    response = await open_sse(request)

    async def body() -> None:
        async for _, event in merge(run.streams):
            raise_if_failed(event)
            if event.text and call.n_predict != 0:
                await send_sse(response, {"content": event.text, "stop": False})
            if event.finish_reason is not None:
                await send_sse(response, infill_final(call, run.model, "", event.usage, event.finish_reason))

    try:
        await guard_disconnect(request, body())
    except (ClientGone, ConnectionResetError):
        pass  # the client left (the next keystroke's request): generation() cancels the stream
    except LocalserveError as e:  # after the 200: the error object in a frame, as non-streamed
        with contextlib.suppress(ConnectionResetError):
            await send_sse(response, openai_exception_body(e, f"infill {run.model}"))
    return response
