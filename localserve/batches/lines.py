"""One batch line through the same functions the HTTP routes call (server/openai_api.py).

A line's body is parsed by the endpoint's own `parse_*` and answered by its own function, so the
line's response body -- or its error body, status and all -- is what the endpoint would have sent
for that body. Only two things differ, on purpose: the line always runs on the `batch` lane (a
`priority` in the body cannot jump the queue of interactive users), and `stream` is refused
(nobody is connected to stream to).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..errors import InvalidRequestError, LocalserveError, OverloadedError, QueueFullError
from ..server.body import parse_json
from ..server.errors import openai_error_body, openai_exception_body
from ..server.openai_api import (
    ApiEnv,
    chat_completion,
    completion,
    embeddings,
    parse_chat,
    parse_completion,
    parse_embeddings,
)
from ..server.validation import Body

log = logging.getLogger(__name__)

Pin = Callable[[str], Awaitable[None]]  # keeps a model loaded for the rest of the batch


@dataclass(frozen=True)
class Endpoint:
    parse: Callable[[Body, ApiEnv], Any]
    run: Callable[[Any, ApiEnv], Awaitable[dict[str, Any]]]
    model_of: Callable[[Any], str]


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(parse_chat, chat_completion, lambda call: call.opts.model),
    "/v1/completions": Endpoint(parse_completion, completion, lambda call: call.opts.model),
    "/v1/embeddings": Endpoint(parse_embeddings, embeddings, lambda call: call.model),
}


@dataclass
class Outcome:
    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == 200


def line_body(raw: str, endpoint: str) -> dict[str, Any]:
    """The request body of a line, after the line's own fields (url, method) are checked."""
    line = parse_json(raw.encode("utf-8"))  # the endpoint's own error for bad JSON
    if not isinstance(line, dict):
        raise InvalidRequestError("a batch line must be a JSON object")
    method = line.get("method")
    if method != "POST":
        raise InvalidRequestError(f"'method' must be \"POST\" (got {str(method)[:20]!r})", param="method")
    if line.get("url") != endpoint:
        raise InvalidRequestError(f"'url' must be the batch's endpoint {endpoint}", param="url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise InvalidRequestError("'body' must be a JSON object (the request body)", param="body")
    if body.get("stream"):
        raise InvalidRequestError("'stream' is not supported in a batch", param="stream")
    return {**body, "priority": "batch"}


async def run_line(raw: str, endpoint: str, env: ApiEnv, pin: Pin) -> Outcome:
    """The line's answer: 200 and the response body, or the error status and body."""
    try:
        spec = ENDPOINTS[endpoint]
        call = spec.parse(Body(line_body(raw, endpoint)), env)
        await pin(spec.model_of(call))
        return Outcome(200, await spec.run(call, env))
    except (QueueFullError, OverloadedError):
        raise  # the lane is full or the model is loading: the runner tries the line again later
    except LocalserveError as exc:
        return Outcome(exc.http_status, openai_exception_body(exc, f"batch line for {endpoint}"))
    except Exception:  # noqa: BLE001 - a bug must fail one line, not the batch or the daemon
        log.exception("batch line for %s failed", endpoint)
        return Outcome(500, openai_error_body("internal server error", "server_error", None, "internal_error"))
