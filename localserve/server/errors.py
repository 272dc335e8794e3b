"""Every failure of the HTTP API becomes a JSON body in the caller's dialect, never a traceback.

/v1 and the rest speak OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; /api/
speaks Ollama's `{"error": "..."}`; /v1/messages (and a /v1 call carrying `anthropic-version`)
Anthropic's `{"type": "error", "error": {"type", "message"}}`, with Anthropic's statuses: the
table of dialects (api/dialects.py) says which. The middleware here maps, in that order: our LocalserveError
tree (http_status / error_type / code / param), aiohttp's own HTTP exceptions (unknown route 404,
wrong method 405, body over client_max_size 413), and anything else to a bare 500 whose details go
only to the log -- a traceback or a host path in a response tells a web page on the same machine
where the user's files are.
"""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable

from aiohttp import web

from ..api.dialects import ANTHROPIC, Dialect, dialect_of
from ..api.errors import ClientGone, safe_message
from ..errors import InternalError, LocalserveError, OverloadedError, QueueFullError

log = logging.getLogger("localserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# aiohttp's HTTP exceptions carry only a status; these are the OpenAI-style type/code we report.
_HTTP_ERRORS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "queue_full"),
    503: ("server_error", "overloaded"),
}


def is_anthropic_request(request: web.Request) -> bool:
    """Anthropic's routes, and any /v1 call of its SDK (which always sends anthropic-version)."""
    return _dialect(request) is ANTHROPIC


def _dialect(request: web.Request) -> Dialect:
    return dialect_of(request.path, "anthropic-version" in request.headers)


def error_response(
    request: web.Request,
    status: int,
    message: str,
    error_type: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after: float | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A JSON error in the dialect of the route family the request went to (api/dialects.py)."""
    status, body = _dialect(request).body(status, message, error_type, param, code)
    all_headers = dict(headers or {})
    if retry_after is not None:
        # Retry-After is whole seconds (RFC 9110); round up so a client never retries too early.
        all_headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return web.json_response(body, status=status, headers=all_headers)


def exception_response(request: web.Request, exc: LocalserveError) -> web.Response:
    retry_after = exc.retry_after if isinstance(exc, (QueueFullError, OverloadedError)) else None
    message = safe_message(exc, f"request {request.method} {request.path}")
    return error_response(
        request, exc.http_status, message, exc.error_type, param=exc.param, code=exc.code, retry_after=retry_after
    )


def http_exception_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    status = exc.status
    error_type, code = _HTTP_ERRORS.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    if status == 404:
        message = f"no route {request.method} {request.path}"
    elif status == 405:
        message = f"method {request.method} not allowed on {request.path}"
    elif status == 413:
        message = "request body too large"
    else:
        message = exc.reason or "error"
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after", "www-authenticate")}
    return error_response(request, status, message, error_type, code=code, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except LocalserveError as exc:
        return exception_response(request, exc)
    except ClientGone:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the access log honest.
        return web.Response(status=499)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like are not errors
            raise
        return http_exception_response(request, exc)
    except ConnectionError:  # ConnectionResetError among them
        raise  # the client left; nothing to answer
    except Exception:  # noqa: BLE001 - the last line of defence: log, answer 500 without details
        log.exception("unhandled error in %s %s", request.method, request.path)
        return exception_response(request, InternalError())


