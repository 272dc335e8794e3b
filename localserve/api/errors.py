"""Error bodies in the dialects' own shapes, built from our error tree; no HTTP here.

`openai_exception_body` is what a /v1 route and a batch line answer with. A 5xx other than
"overloaded" is logged with its details and answered as "internal server error": its text may name
a file or a native error, and a traceback or a host path in a response tells a web page on the same
machine where the user's files are.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import GenerationError, LocalserveError, OverloadedError

log = logging.getLogger("localserve.server")


class ClientGone(Exception):
    """The HTTP client disconnected; nothing can be answered."""


def openai_error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def safe_message(exc: LocalserveError, what: str) -> str:
    """The message a client may see; internal failures (their text may name files or native
    errors) are logged with `what` and answered as "internal server error"."""
    if exc.http_status >= 500 and not isinstance(exc, (OverloadedError, GenerationError)):
        log.error("%s failed: %s", what, exc, exc_info=exc)
        return "internal server error" if exc.http_status == 500 else exc.message
    return exc.message


def openai_exception_body(exc: LocalserveError, what: str) -> dict:
    """The OpenAI error body a /v1 route answers `exc` with (a batch line's error body too)."""
    return openai_error_body(safe_message(exc, what), exc.error_type, exc.param, exc.code)


def json_dumps(data: Any) -> str:
    """Compact JSON; non-ASCII stays readable (clients decode UTF-8) and NaN never leaks out."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
