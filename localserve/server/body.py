"""Bounded reception of request bodies: size and time (the shape of the JSON is api/json_body.py's).

One client must not be able to stall or crash the daemon with its body:
- a declared `Content-Length` above `max_body_bytes` is refused with 413 by a middleware before a
  byte of the body is read (aiohttp itself only notices once it has read `client_max_size` bytes,
  so a client that declares 1 TB and sends nothing would wait forever for an answer);
- the body must arrive within `body_timeout` seconds (408), so a half-sent body cannot hold a
  handler, and the model it was about to pin, indefinitely.

Both refusals of a half-received body close the connection: the unread rest of it would otherwise
be taken for the next request.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..api.json_body import BodyTimeoutError, BodyTooLargeError, body_too_large, parse_json
from ..api.validation import THREAD_PARSE_BYTES, Body, type_name, invalid
from .errors import Handler, exception_response
from .state import SETTINGS_KEY

UPLOAD_SLACK = 64 * 1024  # form fields and boundaries around a file in a multipart upload


@web.middleware
async def body_limits_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """413 for a declared oversize body before the handler runs; 408/413 raised while a handler
    reads the body get a response that closes the connection."""
    settings = request.app[SETTINGS_KEY]
    limit = settings.max_body_bytes
    if request.method == "POST" and request.path == "/v1/files":
        # Batch input files are uploaded whole; batch_routes streams them to disk, not memory.
        limit = settings.batch_max_file_bytes + UPLOAD_SLACK
    try:
        if request.content_length is not None and request.content_length > limit:
            raise body_too_large(limit)
        return await handler(request)
    except (BodyTooLargeError, BodyTimeoutError) as exc:
        response = exception_response(request, exc)
        response.force_close()
        return response
    except web.HTTPRequestEntityTooLarge:
        # aiohttp's own refusal of a chunked body that outgrew client_max_size while being read.
        response = exception_response(request, body_too_large(limit))
        response.force_close()
        return response


async def read_body(request: web.Request) -> bytes:
    """The whole body, within `body_timeout` seconds (0 = no limit) and `max_body_bytes`."""
    timeout = request.app[SETTINGS_KEY].body_timeout
    try:
        return await asyncio.wait_for(request.read(), timeout or None)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(
            f"request body not received within {timeout:g} seconds (setting body_timeout)"
        ) from None


async def read_json(request: web.Request) -> Body:
    """The request body as a JSON object, read and parsed within the limits of server/body.py
    (size, time, nesting depth, integer length): every failure is a 4xx, never a 500."""
    raw = await read_body(request)
    if not raw.strip():
        raise invalid("request body is empty; expected a JSON object", None)
    # An 8 MiB body takes the depth scan and json.loads ~0.1 s: in a worker thread, so /health
    # and every other request keep answering while it parses (test_attacks measures this).
    data = await asyncio.to_thread(parse_json, raw) if len(raw) > THREAD_PARSE_BYTES else parse_json(raw)
    if not isinstance(data, dict):
        raise invalid(f"request body must be a JSON object, not {type_name(data)}", None)
    return Body(data)
