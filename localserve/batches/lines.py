"""One batch line through the same functions the HTTP routes call (server/openai_api.py).

A line's body is parsed by the endpoint's own `parse_*` and answered by its own function, so the
line's response body -- or its error body, status and all -- is what the endpoint would have sent
for that body. Only two things differ, on purpose: the line always runs on the `batch` lane (a
`priority` in the body cannot jump the queue of interactive users), and `stream` is refused
(nobody is connected to stream to).

A line is bounded like an HTTP body (max_body_bytes: 413 before a byte is parsed; create refuses
such lines already, this covers lines stored before a lower setting), and a line over 64 KiB is
parsed in a worker thread as the HTTP path does, so a big line never stalls the event loop. The
runner's ordering of lines (`prefix_key`) runs in a worker thread too (`sort_pending`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..errors import InternalError, InvalidRequestError, LocalserveError, OverloadedError, QueueFullError
from ..api.json_body import BodyTooLargeError, parse_json
from ..api.anthropic import create_message, parse_messages
from ..api.dialects import dialect_of
from ..api.openai import (
    ApiEnv,
    chat_completion,
    completion,
    parse_chat,
    parse_completion,
)
from ..api.openai_embeddings import embeddings, parse_embeddings
from ..api.rerank import parse_rerank, rerank
from ..api.responses import create_response, parse_responses
from ..api.validation import THREAD_PARSE_BYTES, Body

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
    "/v1/rerank": Endpoint(parse_rerank, rerank, lambda call: call.model),
    "/v1/messages": Endpoint(parse_messages, create_message, lambda call: call.chat.opts.model),
    "/v1/responses": Endpoint(parse_responses, create_response, lambda call: call.chat.opts.model),
}


@dataclass
class Outcome:
    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == 200


def line_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """The request body of a line, after the line's own fields (url, method) are checked."""
    line = parse_json(raw)  # the endpoint's own error for bad JSON
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
        data = raw.encode("utf-8")
        limit = env.settings.max_body_bytes
        if len(data) > limit:
            raise BodyTooLargeError(f"request body is larger than {limit} bytes (setting max_body_bytes)")
        body = await asyncio.to_thread(line_body, data, endpoint) if len(data) > THREAD_PARSE_BYTES \
            else line_body(data, endpoint)
        spec = ENDPOINTS[endpoint]
        call = spec.parse(Body(body), env)
        await pin(spec.model_of(call))
        return Outcome(200, await spec.run(call, env))
    except (QueueFullError, OverloadedError):
        raise  # the lane is full or the model is loading: the runner tries the line again later
    except LocalserveError as exc:
        return Outcome(*dialect_of(endpoint).error_body(exc, f"batch line for {endpoint}"))
    except Exception:  # noqa: BLE001 - a bug must fail one line, not the batch or the daemon
        log.exception("batch line for %s failed", endpoint)
        return Outcome(*dialect_of(endpoint).error_body(InternalError(), endpoint))


def sort_pending(lines: list[tuple[int, str | None, str]], max_bytes: int) -> list[tuple[int, str | None, str]]:
    """(In a worker thread: it parses every line.) Pending lines, those sharing a prompt prefix
    next to each other."""
    return sorted(lines, key=lambda line: prefix_key(line[2], max_bytes))


def _body(raw: str, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:  # answered 413 unparsed (run_line); never parsed here either
        return {}
    try:
        line = json.loads(raw)
        body = line.get("body") if isinstance(line, dict) else None
        return body if isinstance(body, dict) else {}
    except (ValueError, RecursionError):
        return {}


def prefix_key(raw: str, max_bytes: int) -> str:
    """Lines whose prompts share a beginning sort next to each other: the model, then the
    messages/prompt/input as JSON text (a shared system prompt is a shared prefix of that text)."""
    body = _body(raw, max_bytes)
    prompt = body.get("messages", body.get("prompt", body.get("input", "")))
    try:
        return f"{body.get('model', '')}\0{json.dumps(prompt, ensure_ascii=False)}"
    except (TypeError, ValueError):
        return ""


def first_model(lines: Any, default: str, max_bytes: int) -> str:
    """(In a worker thread.) The model the first line naming one names, else `default`."""
    for _, _, raw in lines:
        model = _body(raw, max_bytes).get("model")
        if isinstance(model, str) and model:
            return model
    return default
