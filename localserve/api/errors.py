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

from ..errors import GenerationError, InternalError, LocalserveError, OverloadedError

log = logging.getLogger("localserve.server")


class ClientGone(Exception):
    """The HTTP client disconnected; nothing can be answered."""


def openai_error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# Anthropic's error types by status (its API reference, "Errors"); 503 (ours: overloaded, a model
# loading, shutting down) is answered as Anthropic's 529, which its clients retry as "overloaded".
ANTHROPIC_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"), 401: (401, "authentication_error"), 403: (403, "permission_error"),
    404: (404, "not_found_error"), 408: (408, "timeout_error"), 413: (413, "request_too_large"),
    429: (429, "rate_limit_error"), 503: (529, "overloaded_error"), 504: (504, "timeout_error"),
}


def anthropic_error(status: int, message: str) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    default = (status, "invalid_request_error" if status < 500 else "api_error")
    status, error_type = ANTHROPIC_ERRORS.get(status, default)
    return status, {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_exception_body(exc: LocalserveError, what: str) -> tuple[int, dict]:
    """(status, body) an Anthropic route (or a /v1/messages batch line) answers `exc` with."""
    return anthropic_error(exc.http_status, safe_message(exc, what))


def safe_message(exc: LocalserveError, what: str) -> str:
    """The message a client may see; internal failures (their text may name files or native
    errors) are logged with `what` and answered as "internal server error"."""
    if exc.http_status >= 500 and not isinstance(exc, (OverloadedError, GenerationError, InternalError)):
        log.error("%s failed: %s", what, exc, exc_info=exc)
        return "internal server error" if exc.http_status == 500 else exc.message
    return exc.message


def openai_exception_body(exc: LocalserveError, what: str) -> dict:
    """The OpenAI error body a /v1 route answers `exc` with (a batch line's error body too)."""
    return openai_error_body(safe_message(exc, what), exc.error_type, exc.param, exc.code)


def json_dumps(data: Any) -> str:
    """Compact JSON; non-ASCII stays readable (clients decode UTF-8) and NaN never leaks out."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
