"""Rerank routes: `/v1/rerank` and the other paths its clients post to (llama-server's `/rerank`,
`/reranking`, `/v1/reranking`; Cohere's v2 SDK's `/v2/rerank`). Parsing, the engine work and the
answer are api/rerank.py's."""

from __future__ import annotations

from aiohttp import web

from ..api.errors import json_dumps
from ..api.rerank import parse_rerank, rerank
from .body import read_json
from .disconnect import guard_disconnect
from .openai_routes import api_env

routes = web.RouteTableDef()
PATHS = ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking", "/v2/rerank")


async def create_rerank(request: web.Request) -> web.Response:
    env = api_env(request)
    call = parse_rerank(await read_json(request), env)
    return web.json_response(await guard_disconnect(request, rerank(call, env)), dumps=json_dumps)


for _path in PATHS:
    routes.post(_path)(create_rerank)
