"""Ollama-compatible routes (/api/...), for editor plugins and tools that speak Ollama's API.

Field names follow Ollama's API docs: `options` (temperature, top_k, top_p, min_p, seed, stop,
num_predict, repeat_penalty, repeat_last_n, presence/frequency_penalty, num_ctx), `keep_alive`,
`format` ("json" or a JSON schema), NDJSON streaming by default, and the final object's
done_reason and nanosecond durations (total/load/prompt_eval/eval). Errors are `{"error": "..."}`
(errors.py picks that shape for /api/ paths).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from aiohttp import web

from .. import __version__
from ..protocol.engine import EventStream, ModelEngine
from ..errors import LocalserveError
from ..protocol.requests import GenerationEvent, GenerationRequest, Usage
from ..api.errors import json_dumps, safe_message
from ..api.live import mark_fim
from ..api.generation import Clock, chat_template, check_tokens, collect, embed_texts, generation, is_token_list, merge, raise_if_failed, tokenize_async
from .disconnect import guard_disconnect
from .streamed import stream_after_200
from .ndjson import open_ndjson, send_line
from .state import MANAGER_KEY, METRICS_KEY, SETTINGS_KEY, STORE_KEY
from ..api.ollama import (FOREVER, build_request, context_note, details, final_fields, fim_request_tokens, model_name,
                          now_iso, remote_tag, show_body, tag_entry, version_body)
from ..runtime.model_facts import fim_capable
from ..api.tools import ToolCallStream, parse_tool_calls
from ..api.validation import MAX_EMBED_INPUTS, invalid, parse_keep_alive, parse_messages, parse_tools
from .body import read_json
from .served import served

routes = web.RouteTableDef()


async def stream_lines(request: web.Request, streams: list[EventStream],
                       make_line: Callable[[GenerationEvent], dict | None],
                       make_final: Callable[[GenerationEvent], list[dict]]) -> web.StreamResponse:
    """NDJSON: one line per event with text, then the final line(s); a failure is an error line."""
    response = await open_ndjson(request)

    async def body() -> None:
        async for _, event in merge(streams):
            raise_if_failed(event)
            line = make_line(event)
            if line is not None:
                await send_line(response, line)
            if event.finish_reason is not None:
                for final in make_final(event):
                    await send_line(response, final)

    async def send_error(e: LocalserveError) -> None:  # after the 200: Ollama's clients read an "error" line
        await send_line(response, {"error": safe_message(e, f"stream {request.path}")})

    await stream_after_200(request, body(), send_error, request.path)
    return response


async def load_only(request: web.Request, model: str, keep_alive: float | None, extra: dict[str, Any]) -> web.Response:
    """An empty prompt loads the model (or, with keep_alive 0, unloads it), as Ollama does."""
    manager = request.app[MANAGER_KEY]
    # Explicit: a model marked failed after its engine kept crashing is tried again (runtime/crashes.py).
    async with manager.use(model, keep_alive=keep_alive, explicit=True) as loaded:
        name = loaded.name
    unload = keep_alive == 0
    if unload:
        await manager.unload(name)
    return web.json_response({"model": name, "created_at": now_iso(), **extra, "done": True,
                              "done_reason": "unload" if unload else "load"}, dumps=json_dumps)


def _observe(request: web.Request, model: str, usage: Usage | None) -> None:
    request.app[METRICS_KEY].observe_usage(model, usage)


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = model_name(body)
    prompt = body.get_str("prompt", "") or ""
    system = body.get_str("system", None)
    raw = body.get_bool("raw", False)
    stream = body.get_bool("stream", True)
    keep_alive = parse_keep_alive(body.raw("keep_alive"))
    context = body.get_list("context", max_items=1 << 22) or []
    if body.get_list("images", max_items=64):
        raise invalid("this server does not support image input", "images")
    suffix = body.get_str("suffix", None)  # fill-in-the-middle: the prompt is the text before the cursor
    if body.get_str("template", None):
        raise invalid("a custom 'template' is not supported; the model's own chat template is used", "template")
    if not prompt and not context and suffix is None:
        return await load_only(request, model, keep_alive, {"response": ""})
    if suffix is not None and context:
        raise invalid("'suffix' (fill-in-the-middle) cannot continue a 'context'", "suffix")
    if suffix is not None:
        mark_fim()
    if context and not is_token_list(context):
        raise invalid("'context' must be an array of token ids", "context")
    # Bad options fail before any model load; the lane is also the one a wait for the load takes.
    lane = build_request(body, request.headers.get("X-Priority"), None, [], interactive=suffix is not None).lane
    default_max_tokens = request.app[SETTINGS_KEY].default_max_tokens

    async def prepare(engine: ModelEngine) -> list[GenerationRequest]:
        if suffix is not None:  # someone typing waits on it: interactive unless the client says otherwise
            tokens = await fim_request_tokens(body, engine, model, prompt, suffix, default_max_tokens)
            return [build_request(body, request.headers.get("X-Priority"), engine, tokens, interactive=True,
                                  default_max_tokens=default_max_tokens)]
        if raw:
            text, template = prompt, None
        else:
            template = chat_template(engine)
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = await template.render_async(messages)
        # A continuation of `context`: the earlier turn already began with BOS.
        earlier = check_tokens(context, engine.info.n_vocab, "context") if context else []
        tokens = earlier + await tokenize_async(engine, text, template, add_special=not context)
        return [build_request(body, request.headers.get("X-Priority"), engine, tokens, interactive=False,
                              default_max_tokens=default_max_tokens)]

    clock = Clock()
    async with generation(request.app[MANAGER_KEY], model, keep_alive, prepare, clock, lane) as run:
        name, tokens = run.model, run.requests[0].prompt_tokens
        if stream:
            generated: list[int] = []

            def line(event: GenerationEvent) -> dict | None:
                generated.extend(event.token_ids)
                if not event.text:
                    return None
                return {"model": name, "created_at": now_iso(), "response": event.text, "done": False}

            def final(event: GenerationEvent) -> list[dict]:
                _observe(request, name, event.usage)
                return [{"model": name, "created_at": now_iso(), "response": "",
                         **final_fields(clock, event.usage, event.finish_reason), "context": tokens + generated,
                         **context_note(body, run.engine)}]

            return await stream_lines(request, run.streams, line, final)
        (choice,) = await guard_disconnect(request, collect(run.streams))
    _observe(request, name, choice.usage)
    return web.json_response({
        "model": name, "created_at": now_iso(), "response": choice.text,
        **final_fields(clock, choice.usage, choice.finish_reason), "context": tokens + choice.token_ids,
        **context_note(body, run.engine),
    }, dumps=json_dumps)


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = model_name(body)
    stream = body.get_bool("stream", True)
    keep_alive = parse_keep_alive(body.raw("keep_alive"))
    raw_messages = body.get_list("messages", max_items=1 << 16)
    if not raw_messages:
        return await load_only(request, model, keep_alive, {"message": {"role": "assistant", "content": ""}})
    messages = parse_messages(raw_messages)
    tools = parse_tools(body.raw("tools"))
    # Bad options fail before any model load; the lane is also the one a wait for the load takes.
    lane = build_request(body, request.headers.get("X-Priority"), None, [], interactive=stream).lane
    default_max_tokens = request.app[SETTINGS_KEY].default_max_tokens

    async def prepare(engine: ModelEngine) -> list[GenerationRequest]:
        template = chat_template(engine)
        prompt = await template.render_async(messages, tools=tools or None)
        tokens = await tokenize_async(engine, prompt, template)
        return [build_request(body, request.headers.get("X-Priority"), engine, tokens, interactive=stream,
                              default_max_tokens=default_max_tokens)]

    clock = Clock()
    async with generation(request.app[MANAGER_KEY], model, keep_alive, prepare, clock, lane) as run:
        name = run.model
        if stream:
            calls_filter = ToolCallStream(tools) if tools else None

            def line(event: GenerationEvent) -> dict | None:
                text = calls_filter.feed(event.text) if calls_filter else event.text
                if not text:
                    return None
                return {"model": name, "created_at": now_iso(),
                        "message": {"role": "assistant", "content": text}, "done": False}

            def final(event: GenerationEvent) -> list[dict]:
                _observe(request, name, event.usage)
                lines = []
                if calls_filter:
                    rest, calls = calls_filter.finish()
                    if rest or calls:
                        message: dict[str, Any] = {"role": "assistant", "content": rest}
                        if calls:
                            message["tool_calls"] = [c.ollama() for c in calls]
                        lines.append({"model": name, "created_at": now_iso(), "message": message, "done": False})
                lines.append({"model": name, "created_at": now_iso(), "message": {"role": "assistant", "content": ""},
                              **final_fields(clock, event.usage, event.finish_reason), **context_note(body, run.engine)})
                return lines

            return await stream_lines(request, run.streams, line, final)
        (choice,) = await guard_disconnect(request, collect(run.streams))
    _observe(request, name, choice.usage)
    content, calls = parse_tool_calls(choice.text, tools) if tools else (choice.text, [])
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.ollama() for c in calls]
    return web.json_response({"model": name, "created_at": now_iso(), "message": message,
                              **final_fields(clock, choice.usage, choice.finish_reason),
                              **context_note(body, run.engine)}, dumps=json_dumps)


# --- embeddings ----------------------------------------------------------------------------------
def _embed_inputs(value: Any, param: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) and s for s in items):
        raise invalid(f"'{param}' must be a non-empty string or an array of non-empty strings", param)
    if len(items) > MAX_EMBED_INPUTS:
        raise invalid(f"'{param}' may hold at most {MAX_EMBED_INPUTS} items", param)
    return items


def _embed_budget(request: web.Request) -> int:
    return request.app[SETTINGS_KEY].max_embed_tokens


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    body = await read_json(request)
    model = model_name(body)
    inputs = _embed_inputs(body.raw("input"), "input")
    truncate = body.get_bool("truncate", True)
    keep_alive = parse_keep_alive(body.raw("keep_alive"))
    clock = Clock()
    async with request.app[MANAGER_KEY].use(model, keep_alive=keep_alive) as loaded:
        clock.mark_loaded()
        token_lists, vectors = await guard_disconnect(request, embed_texts(
            loaded.engine, inputs, truncate=truncate, param="input", max_tokens=_embed_budget(request)))
    return web.json_response({
        "model": loaded.name, "embeddings": vectors, "total_duration": clock.since_start_ns(),
        "load_duration": clock.load_ns(), "prompt_eval_count": sum(len(t) for t in token_lists),
    }, dumps=json_dumps)


@routes.post("/api/embeddings")
async def embeddings_legacy(request: web.Request) -> web.Response:
    body = await read_json(request)
    model = model_name(body)
    prompt = _embed_inputs(body.raw("prompt"), "prompt")[0]
    async with request.app[MANAGER_KEY].use(model, keep_alive=parse_keep_alive(body.raw("keep_alive"))) as loaded:
        _, (vector,) = await guard_disconnect(request, embed_texts(
            loaded.engine, [prompt], truncate=True, param="prompt", max_tokens=_embed_budget(request)))
    return web.json_response({"embedding": vector}, dumps=json_dumps)


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    models = await asyncio.to_thread(request.app[STORE_KEY].list)
    entries = [tag_entry(m) for m in models]
    pool = request.app[MANAGER_KEY].upstreams
    if pool is not None:
        local = {m.ref for m in models}
        entries += [remote_tag(name, ups) for name, ups in pool.models().items() if name not in local]
    return web.json_response({"models": entries})


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    body = await read_json(request)
    model = await asyncio.to_thread(request.app[STORE_KEY].find, model_name(body))
    context = (await served(request, model)).context
    fim = await asyncio.to_thread(fim_capable, model)
    return web.json_response(show_body(model, context, now_iso(model.modified), fim), dumps=json_dumps)


@routes.get("/api/ps")
async def ps(request: web.Request) -> web.Response:
    """Ollama's fields, plus ours that `localserve ps` shows: state, pinned, running, waiting per lane."""
    store = request.app[STORE_KEY]
    out = []
    for row in request.app[MANAGER_KEY].status():
        try:
            model_details = details(await asyncio.to_thread(store.find, row["name"]))
        except LocalserveError:
            model_details = {}
        expires = row.get("expires_at")
        if expires is None and row.get("pinned") and row.get("keep_alive", -1) >= 0:
            expires = time.time() + row["keep_alive"]  # in use: it expires keep_alive after the last request
        out.append({
            "name": row["name"], "model": row["name"], "size": row.get("memory_bytes", 0),
            "digest": row.get("sha256") or "", "details": model_details,
            "expires_at": now_iso(expires) if expires is not None else FOREVER,
            # llama.cpp's own device buffer sizes where the engine reported an offload, else the plan's.
            "size_vram": row["gpu_memory_bytes"] if row.get("gpu_layers") else row.get("vram_bytes", 0),
            "gpu_layers": row.get("gpu_layers", 0), "offloadable_layers": row.get("offloadable_layers", 0),
            "state": row.get("state", "loaded"), "pinned": row.get("pinned", 0),
            "running": row.get("running", 0), "waiting": row.get("waiting", {}),
            "waiting_for_load": row.get("waiting_for_load", 0), "reason": row.get("reason", ""),
            "context_length": row.get("context_length", 0), "max_sequences": row.get("max_sequences", 0),
            # The engine's own process (engine/worker/) and how often one died for this model.
            "worker": row.get("worker"), "restarts": row.get("restarts", 0),
            **({"remote": True, "upstreams": row.get("upstreams", [])} if row.get("remote") else {}),
        })
    pool = request.app[MANAGER_KEY].upstreams
    extra = {"upstreams": pool.status()} if pool is not None else {}
    return web.json_response({"models": out, **extra}, dumps=json_dumps)


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    body = await read_json(request)
    store = request.app[STORE_KEY]
    model = await asyncio.to_thread(store.find, model_name(body))
    await request.app[MANAGER_KEY].unload(model.ref)
    await asyncio.to_thread(store.remove, model.ref)
    return web.Response(status=200)


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response(version_body(__version__))
