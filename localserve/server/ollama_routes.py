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
from dataclasses import replace
from typing import Any, Callable

from aiohttp import web

from .. import __version__
from ..protocol.engine import EventStream
from ..errors import LocalserveError
from ..protocol.requests import GenerationEvent, Usage
from ..api.errors import json_dumps, safe_message
from ..api.generation import Clock, Run, collect, embed_texts, generation, merge, raise_if_failed
from ..api.ollama import (FOREVER, created_tag, details, model_name, now_iso, remote_tag, show_body, tag_entry,
                          version_body)
from ..api.ollama_models import overlay, parse_copy, parse_create, show_overlay
from ..api.images import ImageParts
from ..api.ollama_chat import (ChatAnswer, ChatCall, GenerateAnswer, GenerateCall, OllamaCall, parse_chat,
                               parse_generate)
from ..api.validation import MAX_EMBED_INPUTS, Body, invalid, parse_keep_alive
from ..store.created import CreatedModel, CreatedModels
from ..runtime.model_facts import fim_capable
from ..runtime.resolve import resolve
from .disconnect import guard_disconnect
from .ndjson import held_ndjson, line_bytes, send_line
from .state import MANAGER_KEY, METRICS_KEY, SETTINGS_KEY, STORE_KEY
from .streamed import run_stream
from .body import read_json
from .served import lora_adapters, served

routes = web.RouteTableDef()


async def stream_lines(request: web.Request, streams: list[EventStream], answer: GenerateAnswer | ChatAnswer,
                       make_final: Callable[[GenerationEvent], list[dict]]) -> web.StreamResponse:
    """NDJSON: one line per event with text, then the final line(s); a failure is an error line."""
    # A silence gets a line Ollama's clients parse (empty text, done: false), not nothing: Cline's
    # Ollama provider gave up at its 300 s total timeout while a long prompt was read.
    out = held_ndjson(request, lambda: line_bytes(answer.keepalive()))

    async def body() -> None:
        async for _, event in merge(streams):
            raise_if_failed(event)
            line = answer.line(event)
            if line is not None:
                await send_line(out, line)
            if event.finish_reason is not None:
                for final in make_final(event):
                    await send_line(out, final)

    async def send_error(e: LocalserveError) -> None:
        # After the 200: Ollama's clients raise on an "error" line; readers that wait for `done`
        # get it too, with the reason.
        await send_line(out, {"error": safe_message(e, f"stream {request.path}")})
        await send_line(out, {**answer.keepalive(), "done": True, "done_reason": "error"})

    return await run_stream(out, body(), send_error, request.path)


async def load_only(request: web.Request, call: OllamaCall, extra: dict[str, Any]) -> web.Response:
    """An empty prompt loads the model (or, with keep_alive 0, unloads it), as Ollama does."""
    manager = request.app[MANAGER_KEY]
    # Explicit: a model marked failed after its engine kept crashing is tried again (runtime/crashes.py).
    async with manager.use(call.model, keep_alive=call.keep_alive, explicit=True) as loaded:
        name = loaded.name
    unload = call.keep_alive == 0
    if unload:
        await manager.unload(name)
    return web.json_response({"model": name, "created_at": now_iso(), **extra, "done": True,
                              "done_reason": "unload" if unload else "load"}, dumps=json_dumps)


def _observe(request: web.Request, model: str, usage: Usage | None) -> None:
    request.app[METRICS_KEY].observe_usage(model, usage)


async def _answer(request: web.Request, call: GenerateCall | ChatCall,
                  answer_for: Callable[[Run, Clock], GenerateAnswer | ChatAnswer]) -> web.StreamResponse:
    """The call's generation, streamed as NDJSON lines or answered whole."""
    clock = Clock()
    async with generation(request.app[MANAGER_KEY], call.model, call.keep_alive, call.prepare, clock, call.lane,
                          images=call.images) as run:
        answer = answer_for(run, clock)
        if call.stream:
            def final(event: GenerationEvent) -> list[dict]:
                _observe(request, run.model, event.usage)
                return answer.final(event)

            return await stream_lines(request, run.streams, answer, final)
        (choice,) = await guard_disconnect(request, collect(run.streams))
    _observe(request, run.model, choice.usage)
    return web.json_response(answer.whole(choice), dumps=json_dumps)


def _call_args(request: web.Request) -> tuple[str | None, int, ImageParts]:
    settings = request.app[SETTINGS_KEY]
    return request.headers.get("X-Priority"), settings.default_max_tokens, ImageParts.of(settings)


async def _body_for(request: web.Request, *, chat: bool) -> tuple[Body, CreatedModel | None]:
    """The request's body, with the overlay of the created model it names (api/ollama_models.py)."""
    body = await read_json(request)
    name = body.raw("model") or body.raw("name")
    created = await asyncio.to_thread(_created(request).get, name) if isinstance(name, str) and name else None
    return (Body(overlay(body.data, created, chat=chat)) if created else body), created


def _created(request: web.Request) -> CreatedModels:
    return CreatedModels(request.app[SETTINGS_KEY])


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    body, created = await _body_for(request, chat=False)
    call = parse_generate(body, *_call_args(request))
    call.template = created.template if created else None
    if call.loads_only:
        return await load_only(request, call, {"response": ""})
    return await _answer(request, call, lambda run, clock: GenerateAnswer(
        call, run.model, run.requests[0].prompt_tokens, run.engine, clock))


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    body, created = await _body_for(request, chat=True)
    call = parse_chat(body, *_call_args(request))
    call.template = created.template if created else None
    if call.loads_only:
        return await load_only(request, call, {"message": {"role": "assistant", "content": ""}})
    return await _answer(request, call, lambda run, clock: ChatAnswer(call, run.model, run.engine, clock))


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
    by_ref = {m.ref.lower(): m for m in models}
    for made in (await asyncio.to_thread(_created(request).all)).values():
        source = by_ref.get(made.source.lower())
        entries.append(created_tag(made, source))
    pool = request.app[MANAGER_KEY].upstreams
    if pool is not None:
        local = {m.ref for m in models}
        entries += [remote_tag(name, ups) for name, ups in pool.models().items() if name not in local]
    return web.json_response({"models": entries})


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    name = model_name(await read_json(request))
    created = await asyncio.to_thread(_created(request).get, name)
    model = await asyncio.to_thread(request.app[STORE_KEY].find, created.source if created else name)
    limits = await served(request, model)
    fim = await asyncio.to_thread(fim_capable, model)
    show = show_body(model, limits.context, now_iso(created.modified if created else model.modified), fim,
                     vision=limits.vision, audio=limits.audio, loras=lora_adapters(request, model))
    return web.json_response(show_overlay(show, created) if created else show, dumps=json_dumps)


@routes.post("/api/create")
async def create(request: web.Request) -> web.StreamResponse:
    """A new name for a model served here, with an overlay (store/created.py); Ollama's progress
    lines, or one object with stream false."""
    body = await read_json(request)
    made = parse_create(body, _created(request).get)
    await _refuse_shadowing(request, made.name)
    await _served(request, made.source)
    await asyncio.to_thread(_created(request).put, made)
    return await _status_lines(request, body, [f"using model {made.source}", "writing manifest", "success"])


@routes.post("/api/copy")
async def copy(request: web.Request) -> web.Response:
    source, destination = parse_copy(await read_json(request))
    made = await asyncio.to_thread(_created(request).get, source)
    if made is None:
        await _served(request, source)
        made = CreatedModel(name=destination, source=source)
    await _refuse_shadowing(request, destination)
    await asyncio.to_thread(_created(request).put, replace(made, name=destination, modified=time.time()))
    return web.Response(status=200)


async def _served(request: web.Request, name: str) -> None:
    """ModelNotFoundError (404) for a name nothing here serves: a created model needs a source."""
    app = request.app
    await resolve(name, app[STORE_KEY], app[MANAGER_KEY].upstreams, app[SETTINGS_KEY])


async def _refuse_shadowing(request: web.Request, name: str) -> None:
    """A created name that an installed model already answers to would never be reached."""
    try:
        installed = await asyncio.to_thread(request.app[STORE_KEY].find, name)
    except LocalserveError:
        return
    raise invalid(f"{name!r} is the installed model {installed.ref}: create another name", "model")


async def _status_lines(request: web.Request, body: Body, statuses: list[str]) -> web.StreamResponse:
    if not body.get_bool("stream", True):
        return web.json_response({"status": statuses[-1]})
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    for status in statuses:
        await send_line(response, {"status": status})
    await response.write_eof()
    return response


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
        held, most = row.get("memory_held_bytes"), row.get("memory_max_bytes", row.get("memory_bytes", 0))
        out.append({
            # Ollama's clients (`ollama ps`, web UIs) show `size` as the memory a model uses, and
            # split it CPU/GPU as size_vram / size. Ollama reserves its whole KV cache at load, so
            # for it the two are one figure; ours commits KV as requests use it, so `size` is what
            # is held now (it includes size_vram: the split stays within 100%), or the plan where
            # nothing can be measured (an engine in the daemon's process). Ours beside it:
            # size_held (null when unmeasured) and size_max, the most it may grow to.
            "name": row["name"], "model": row["name"], "size": most if held is None else held,
            "size_held": held, "size_max": most,
            "digest": row.get("sha256") or "", "details": model_details,
            "expires_at": now_iso(expires) if expires is not None else FOREVER,
            # llama.cpp's own device buffer sizes where the engine reported an offload, else the plan's.
            "size_vram": row["gpu_memory_bytes"] if row.get("gpu_layers") else row.get("vram_bytes", 0),
            "gpu_layers": row.get("gpu_layers", 0), "offloadable_layers": row.get("offloadable_layers", 0),
            "moe_layers_in_ram": row.get("moe_layers_in_ram", 0),  # cpu_moe: layers whose experts stay in RAM
            "size_vram_by_device": row.get("gpu_memory_by_device", {}),  # a load over several GPUs, per card
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
    name = model_name(await read_json(request))
    if await asyncio.to_thread(_created(request).remove, name) is not None:
        return web.Response(status=200)  # the created name only: its source stays
    store = request.app[STORE_KEY]
    model = await asyncio.to_thread(store.find, name)
    await request.app[MANAGER_KEY].unload(model.ref)
    await asyncio.to_thread(store.remove, model.ref)
    return web.Response(status=200)


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response(version_body(__version__))
