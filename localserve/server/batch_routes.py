"""OpenAI's Files and Batches routes: /v1/files[/{id}[/content]], /v1/batches[/{id}[/cancel]].

HTTP only: multipart upload streamed to a temporary file under the size limit, JSON in and out.
The state and the work are localserve/batches/ (store, runner), which runs on the app's lifetime
(`batch_runner` in cleanup_ctx: started with the server, resumes unfinished batches, stopped
before the model manager closes so its pinned models are released first).
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any, AsyncIterator

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from ..batches.files import file_object, new_id
from ..batches.runner import BatchRunner, check_endpoint, public
from ..errors import DiskFullError, InvalidRequestError
from ..api.json_body import BodyTimeoutError
from ..api.errors import json_dumps
from .state import MANAGER_KEY, METRICS_KEY, SETTINGS_KEY
from ..api.validation import Body
from .body import read_json

routes = web.RouteTableDef()
BATCHES_KEY = web.AppKey("batches", BatchRunner)
CHUNK = 256 * 1024
MAX_METADATA = 16  # OpenAI's bounds on a batch's metadata: 16 pairs, keys 64, values 512 chars


async def batch_runner(app: web.Application) -> AsyncIterator[None]:
    runner = BatchRunner(app[SETTINGS_KEY], app[MANAGER_KEY], app[METRICS_KEY])
    app[BATCHES_KEY] = runner
    await runner.start()
    yield
    await runner.close()


def _reply(data: Any) -> web.Response:
    return web.json_response(data, dumps=json_dumps)


# --- files ---------------------------------------------------------------------------------------
@routes.post("/v1/files")
async def upload_file(request: web.Request) -> web.Response:
    runner = request.app[BATCHES_KEY]
    if not request.content_type.startswith("multipart/"):
        raise InvalidRequestError("upload the file as multipart/form-data with fields 'file' and 'purpose'")
    timeout = request.app[SETTINGS_KEY].body_timeout
    try:
        purpose, saved = await asyncio.wait_for(_read_upload(request, runner), timeout or None)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(f"the upload was not received within {timeout:g} seconds (setting body_timeout)") from None
    tmp, filename, size = saved
    try:
        if purpose != "batch":
            raise InvalidRequestError("'purpose' must be \"batch\" (the only purpose served here)", param="purpose")
        file_id = new_id("file-")
        await asyncio.to_thread(runner.files.publish, tmp, file_id)
    finally:
        tmp.unlink(missing_ok=True)
    obj = file_object(file_id, filename, purpose, size)
    await runner.store.call(runner.store.add_file, obj)
    return _reply(obj)


async def _read_upload(request: web.Request, runner: BatchRunner) -> tuple[str | None, Any]:
    try:
        reader = await request.multipart()
    except ValueError:  # aiohttp's words for it quote the whole header back: ours instead
        raise InvalidRequestError("a multipart/form-data upload needs a boundary (of at most 70 characters) "
                                  "in its Content-Type") from None
    purpose: str | None = None
    saved = None
    limit = runner.settings.batch_max_file_bytes
    try:
        while (part := await _next_part(reader)) is not None:
            if part.name == "purpose":
                purpose = (await part.text())[:64]  # type: ignore[union-attr]
            elif part.name == "file" and saved is None:
                saved = await _save_part(part, runner, limit)
            else:
                await part.release()  # type: ignore[union-attr]
    except BaseException:
        if saved is not None:
            saved[0].unlink(missing_ok=True)
        raise
    if saved is None:
        raise InvalidRequestError("the form has no 'file' part", param="file")
    return purpose, saved


async def _next_part(reader: Any) -> Any:
    """The form's next part; a malformed form is the client's 400, not our 500."""
    try:
        return await reader.next()
    except LineTooLong:
        raise InvalidRequestError("a header line of a form part is longer than 8190 bytes") from None
    except (ValueError, HttpProcessingError):  # a wrong boundary line, too many headers
        raise InvalidRequestError("the multipart/form-data body is malformed") from None


async def _save_part(part: Any, runner: BatchRunner, limit: int) -> tuple[Any, str, int]:
    """The part streamed to a temporary file under .tmp/, refused past `limit` bytes."""
    await asyncio.to_thread(runner.files.check_room, 0)
    tmp, f = await asyncio.to_thread(runner.files.staging)
    size = 0
    try:
        with f:
            while chunk := await part.read_chunk(CHUNK):
                size += len(chunk)
                if size > limit:
                    raise InvalidRequestError(
                        f"the file is larger than {limit} bytes (setting batch_max_file_bytes)", param="file")
                await asyncio.to_thread(f.write, chunk)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DiskFullError("the file could not be stored: the disk is full") if e.errno == errno.ENOSPC else e from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    name = (part.filename or "upload.jsonl").replace("/", "_").replace("\\", "_")[:255]
    return tmp, name, size


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    runner = request.app[BATCHES_KEY]
    files = await runner.store.call(runner.store.list_files)
    return _reply({"object": "list", "data": files, "has_more": False})


@routes.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    runner = request.app[BATCHES_KEY]
    return _reply(await runner.store.call(runner.store.get_file, request.match_info["file_id"]))


@routes.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.StreamResponse:
    runner = request.app[BATCHES_KEY]
    file_id = request.match_info["file_id"]
    await runner.store.call(runner.store.get_file, file_id)  # 404 for ids the store does not know
    return web.FileResponse(runner.files.path(file_id), headers={"Content-Type": "application/jsonl"})


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    runner = request.app[BATCHES_KEY]
    file_id = request.match_info["file_id"]
    await runner.store.call(runner.store.delete_file, file_id)
    await asyncio.to_thread(runner.files.delete, file_id)
    return _reply({"id": file_id, "object": "file", "deleted": True})


# --- batches -------------------------------------------------------------------------------------
@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    body = await read_json(request)
    input_file_id = body.get_str("input_file_id", None, max_len=128)
    if not input_file_id:
        raise InvalidRequestError("'input_file_id' is required", param="input_file_id")
    endpoint = check_endpoint(body.raw("endpoint"))
    if body.get_str("completion_window", "24h", max_len=16) != "24h":
        raise InvalidRequestError("'completion_window' must be \"24h\"", param="completion_window")
    return _reply(await request.app[BATCHES_KEY].create(input_file_id, endpoint, parse_metadata(body)))


def parse_metadata(body: Body) -> dict[str, str] | None:
    value = body.raw("metadata")
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise InvalidRequestError("'metadata' must be an object of at most 16 string pairs (keys up to 64, "
                                  "values up to 512 characters)", param="metadata")
    return dict(value)


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    runner = request.app[BATCHES_KEY]
    query = Body(dict(request.query))
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequestError("'limit' must be an integer from 1 to 100", param="limit")
    after = query.get_str("after", None, max_len=128)
    items, has_more = await runner.store.call(runner.store.list_batches, after, limit)
    data = [public(b) for b in items]
    return _reply({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                   "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@routes.get("/v1/batches/{batch_id}")
async def get_batch(request: web.Request) -> web.Response:
    return _reply(await request.app[BATCHES_KEY].get(request.match_info["batch_id"]))


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    return _reply(await request.app[BATCHES_KEY].cancel(request.match_info["batch_id"]))
