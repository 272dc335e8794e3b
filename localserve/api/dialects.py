"""The one table of dialects: which wire dialect each path speaks, and how its errors look.

Read by the error middleware (server/errors.py: the body of a failed request), the streamed-reply
helper's callers (a failure after the 200), the dashboard's origin column (api/live.py) and the
Batch API (batches/lines.py: a failed line's status and body). A new dialect is an `api/` module,
a route file and a row here.

Paths that no generating route names still answer errors in a family's shape: /api/* in
Ollama's, /v1/messages and every /v1 call of Anthropic's SDK (it always sends
`anthropic-version`) in Anthropic's, everything else in OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import LocalserveError
from .errors import anthropic_error, openai_error_body, safe_message

# (status, message, error type, param, code) -> the status and body this dialect answers
BodyMaker = Callable[[int, str, str, "str | None", "str | None"], "tuple[int, dict[str, Any]]"]


@dataclass(frozen=True)
class Dialect:
    name: str  # what the dashboard's origin column shows
    body: BodyMaker

    def error_body(self, exc: LocalserveError, what: str) -> tuple[int, dict[str, Any]]:
        """The status and body `exc` is answered with (internal details logged with `what`)."""
        return self.body(exc.http_status, safe_message(exc, what), exc.error_type, exc.param, exc.code)


def _openai(status: int, message: str, error_type: str, param: str | None, code: str | None) -> tuple[int, dict]:
    return status, openai_error_body(message, error_type, param, code)


def _anthropic(status: int, message: str, error_type: str, param: str | None, code: str | None) -> tuple[int, dict]:
    return anthropic_error(status, message)  # its own types by status; 503 becomes its 529


def _ollama(status: int, message: str, error_type: str, param: str | None, code: str | None) -> tuple[int, dict]:
    return status, {"error": message}


def _llamacpp(status: int, message: str, error_type: str, param: str | None, code: str | None) -> tuple[int, dict]:
    # llama-server's format_error_response: the status as the numeric code (vLLM's errors carry it too).
    return status, {"error": {"code": status, "message": message, "type": error_type, "param": param}}


OPENAI = Dialect("openai", _openai)
ANTHROPIC = Dialect("anthropic", _anthropic)
OLLAMA = Dialect("ollama", _ollama)
RESPONSES = Dialect("responses", _openai)
FIM = Dialect("fim", _openai)  # llama.cpp's routes: OpenAI-shaped errors, as llama-server answers

# The routes that generate, each with its dialect.
ROUTES: dict[str, Dialect] = {
    "/v1/chat/completions": OPENAI, "/v1/completions": OPENAI, "/v1/embeddings": OPENAI,
    **dict.fromkeys(("/v1/rerank", "/rerank", "/v1/reranking", "/reranking", "/v2/rerank"), OPENAI),
    "/api/generate": OLLAMA, "/api/chat": OLLAMA, "/api/embed": OLLAMA, "/api/embeddings": OLLAMA,
    "/v1/messages": ANTHROPIC, "/v1/responses": RESPONSES,
    "/infill": FIM, "/completion": FIM, "/v1/fim/completions": FIM, "/fim/completions": FIM,
}


TOKENS = Dialect("tokens", _llamacpp)
# Routes that generate nothing (so no origin on the dashboard) and answer errors in a shape of their own.
OTHER_ROUTES: dict[str, Dialect] = {"/tokenize": TOKENS, "/detokenize": TOKENS, "/apply-template": TOKENS}


def dialect_of(path: str, anthropic_version: bool = False) -> Dialect:
    """The dialect a request to `path` is answered in (`anthropic_version`: it sent that header)."""
    if path == "/api" or path.startswith("/api/"):
        return OLLAMA
    if path == "/v1/messages" or path.startswith("/v1/messages/") or (anthropic_version and path.startswith("/v1/")):
        return ANTHROPIC
    return ROUTES.get(path) or OTHER_ROUTES.get(path, OPENAI)
