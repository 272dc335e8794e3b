"""Bounded reception of request bodies: size, time, and the shape of the JSON in them.

One client must not be able to stall or crash the daemon with its body:
- a declared `Content-Length` above `max_body_bytes` is refused with 413 by a middleware before a
  byte of the body is read (aiohttp itself only notices once it has read `client_max_size` bytes,
  so a client that declares 1 TB and sends nothing would wait forever for an answer);
- the body must arrive within `body_timeout` seconds (408), so a half-sent body cannot hold a
  handler, and the model it was about to pin, indefinitely;
- JSON nested deeper than MAX_JSON_DEPTH is refused (400) before it is parsed: `json.loads` and
  every later walk over the data (schema compilers, templates, `json.dumps`) recurse per level,
  and a RecursionError deep inside one of them would be a 500;
- an integer literal longer than MAX_INT_DIGITS is refused (400): Python refuses to convert one
  over 4300 digits with a ValueError (sys.set_int_max_str_digits), and shorter ones still cost
  quadratic time to convert while no field of either API needs more than 20 digits.

Both refusals of a half-received body close the connection: the unread rest of it would otherwise
be taken for the next request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
from aiohttp import web

from ..errors import InvalidRequestError
from .errors import Handler, exception_response
from .state import SETTINGS_KEY

MAX_JSON_DEPTH = 128
MAX_INT_DIGITS = 256
UPLOAD_SLACK = 64 * 1024  # form fields and boundaries around a file in a multipart upload
_BRACKETS = np.frombuffer(b"[]{}", dtype=np.uint8)

class BodyTooLargeError(InvalidRequestError):
    http_status = 413
    code = "request_too_large"


class BodyTimeoutError(InvalidRequestError):
    http_status = 408
    code = "request_timeout"


def _too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"request body is larger than {limit} bytes (setting max_body_bytes)")


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
            raise _too_large(limit)
        return await handler(request)
    except (BodyTooLargeError, BodyTimeoutError) as exc:
        response = exception_response(request, exc)
        response.force_close()
        return response
    except web.HTTPRequestEntityTooLarge:
        # aiohttp's own refusal of a chunked body that outgrew client_max_size while being read.
        response = exception_response(request, _too_large(limit))
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


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw`, counted without recursion or regular
    expressions (a regex over strings retries an unterminated one from every later quote: minutes
    for a few hundred kB of `\\"`), in a few linear passes that take milliseconds for 8 MB."""
    # Escaped backslashes first (pairs from the left, as a JSON reader takes them), then escaped
    # quotes: every quote left opens or closes a string.
    text = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    codes = np.frombuffer(text, dtype=np.uint8)
    inside = np.bitwise_xor.accumulate(codes == 0x22)  # True from an opening quote to its closing one
    brackets = codes[~inside & np.isin(codes, _BRACKETS)]
    if not brackets.size:
        return 0
    # '[' 0x5B and '{' 0x7B have bit 1 set, ']' 0x5D and '}' 0x7D do not.
    steps = ((brackets >> 1) & 1).astype(np.int8) * 2 - 1
    return int(np.cumsum(steps, dtype=np.int32).max())


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidRequestError(f"request body has an integer with more than {MAX_INT_DIGITS} digits", param=None)
    return int(text)


def parse_json(raw: bytes) -> Any:
    """`raw` parsed as JSON, every malformed or hostile input an InvalidRequestError (400)."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw, parse_int=_bounded_int)
    except UnicodeDecodeError:
        raise InvalidRequestError("request body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise InvalidRequestError(
            f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except (ValueError, RecursionError):  # belt and braces: the checks above should stop both
        raise InvalidRequestError("request body is not valid JSON") from None
