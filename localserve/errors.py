"""The one error tree of localserve.

Every message is safe to show to a user or an HTTP client: no host paths, no tracebacks. The CLI
prints `str(error)` on one line and exits with `exit_code`; the server maps each class to an HTTP
status and an OpenAI error body (`server/errors.py`) through `http_status`, `error_type` and `code`.

    LocalserveError
    ├── ConfigError                  bad setting / config file
    ├── InvalidRequestError          bad input from a user or client (400)
    │   ├── InvalidNameError         a model name/tag that could escape the cache directory
    │   └── ContextLengthExceededError
    ├── ModelNotFoundError           not in the catalog / not pulled (404)
    ├── NotFoundError                an unknown file, batch or stored response id (404)
    ├── GGUFError                    malformed, truncated or non-GGUF file
    ├── ModelDirError                an ONNX / onnxruntime-genai model folder that is incomplete or corrupt
    ├── DownloadError                pull failures
    │   ├── NetworkError             cannot reach the source (after retries)
    │   ├── HTTPStatusError          401/403/404/5xx from the source
    │   ├── ChecksumMismatchError    bytes do not match the sha256 (bad file removed)
    │   ├── DiskFullError            not enough free space
    │   └── PullLockedError          another process is pulling the same model
    ├── QueueFullError               a lane's queue is full (429 + Retry-After)
    ├── OverloadedError              the whole server is full or a model is loading (503)
    │   ├── RequestCancelledError    the server ended a request: shutdown, unload (503 + Retry-After)
    │   │   └── SwapPreemptedError   batch-lane work ended at a step boundary so another model can load
    │   ├── EngineCrashedError       a model's engine worker died under its requests (503, restarted)
    │   └── ModelFailedError         a model whose worker kept crashing, until loaded again explicitly
    ├── BackendError                 a model failed to load or decode (500, details only in the log)
    ├── GenerationError              a request failed inside the engine (500, our message, shown)
    ├── InternalError                an unexpected failure, logged where it was caught (500)
    ├── RequestSupersededError       a newer request for the same id_slot ended this one (409)
    ├── UpstreamError                a remote upstream failed or refused (502)
    └── DaemonError                  the daemon cannot be started, reached or stopped, or answered an error

Subclasses that belong to one module live there (api/json_body.py's body limits, convert/'s
unsupported models, the Responses store's unknown previous response, launch's and setup's own).
"""

from __future__ import annotations

import re
from typing import Sequence

# An absolute path standing on its own (not the path part of a URL): /x/y or C:\x\y.
_HOST_PATH = re.compile(r"(?<![\w:/.\\])(?:[A-Za-z]:\\|/)[^\s'\"]+")


def redact_paths(text: str) -> str:
    """Replace host paths in text we did not write (a subprocess's error line) by their last part,
    so the message can go into an error without telling a client where things live."""
    return _HOST_PATH.sub(lambda m: re.split(r"[\\/]", m.group(0).rstrip("/\\"))[-1] or "/", text)


class LocalserveError(Exception):
    http_status = 500
    error_type = "server_error"
    code: str | None = None
    exit_code = 1

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple:
        # Exception's own pickling calls cls(*args), which fails for the subclasses whose
        # __init__ takes other arguments (QueueFullError's retry_after): errors cross the pipe to
        # and from an engine's worker process (engine/worker/), so every class rebuilds from its
        # args and attributes instead.
        return _rebuild_error, (type(self), self.args, self.__dict__)


def _rebuild_error(cls: type, args: tuple, state: dict) -> "LocalserveError":
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ConfigError(LocalserveError):
    exit_code = 2


class InvalidRequestError(LocalserveError):
    http_status = 400
    error_type = "invalid_request_error"
    exit_code = 2


class InvalidNameError(InvalidRequestError):
    code = "invalid_model_name"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(LocalserveError):
    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, name: str, suggestions: Sequence[str] = (), *, message: str | None = None):
        text = message or f"model {name!r} not found"
        if suggestions:
            text += f" (did you mean: {', '.join(suggestions)}?)"
        super().__init__(text, param="model")
        self.name = name
        self.suggestions = list(suggestions)


class NotFoundError(LocalserveError):
    http_status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class GGUFError(LocalserveError):
    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_model_file"


class ModelDirError(LocalserveError):
    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_model_dir"


class DownloadError(LocalserveError):
    http_status = 502
    code = "download_failed"


class NetworkError(DownloadError):
    pass


class HTTPStatusError(DownloadError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ChecksumMismatchError(DownloadError):
    code = "checksum_mismatch"


class DiskFullError(DownloadError):
    http_status = 507
    code = "disk_full"


class PullLockedError(DownloadError):
    http_status = 409
    code = "pull_in_progress"


class QueueFullError(LocalserveError):
    http_status = 429
    error_type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class OverloadedError(LocalserveError):
    http_status = 503
    error_type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class BackendError(LocalserveError):
    code = "backend_error"


class GenerationError(LocalserveError):
    """A request failed inside the engine (its decode failed, its KV ran out, its sampler broke).
    The engine writes the message, so unlike BackendError's it is shown to the client."""

    code = "generation_failed"


class InternalError(LocalserveError):
    """An unexpected failure (a bug), already logged with its traceback where it was caught; the
    client sees only this, in its dialect's shape."""

    code = "internal_error"

    def __init__(self) -> None:
        super().__init__("internal server error")


class RequestCancelledError(OverloadedError):
    """The server ended a request before it finished (shutdown, unload): a retry may succeed."""

    code = "request_cancelled"

    def __init__(self, message: str = "the request was cancelled by the server (shutting down or unloading "
                 "the model)", retry_after: float = 1.0):
        super().__init__(message, retry_after)


class RequestSupersededError(LocalserveError):
    """The same client sent a newer request for the same `id_slot` (server/slots.py): an editor's
    next keystroke. Not retryable: the client wants the newer answer."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "superseded"

    def __init__(self, slot: int):
        super().__init__(f"a newer request for id_slot {slot} superseded this one")
        self.slot = slot


class EngineCrashedError(OverloadedError):
    """The worker process that ran a model's engine ended (a native crash, an abort, killed for
    memory or for hanging): its requests end with this, and the model loads again on the next
    request (runtime/crashes.py). A retry after Retry-After may succeed. `reason`: how it ended
    ("SIGSEGV", "hung: no progress for 31 s"), which the manager counts toward marking it failed."""

    code = "engine_crashed"

    def __init__(self, message: str, reason: str, retry_after: float = 2.0):
        super().__init__(message, retry_after)
        self.reason = reason


class ModelFailedError(OverloadedError):
    """A model whose engine worker crashed three times in a row is not loaded again on its own
    (runtime/crashes.py), until the user loads it explicitly."""

    code = "model_failed"


class SwapPreemptedError(RequestCancelledError):
    """A batch-lane request ended at a step boundary because a better-lane request for another
    model needed its model's memory (runtime/swaps.py). Nothing of it was answered: the Batch API
    runner runs the line again once the model is back, so its custom_id is still written once."""

    code = "model_swap"

    def __init__(self, model: str, retry_after: float = 1.0):
        super().__init__(f"this batch-lane request was ended so that another model could be loaded in place of "
                         f"{model}; retry it after the swap", retry_after)


class UpstreamError(LocalserveError):
    """A remote upstream failed or refused in a way the client cannot fix (502). The message names
    the upstream and its status, never its URL's key or its internal details."""

    http_status = 502
    code = "upstream_error"


class DaemonError(LocalserveError):
    """Raised in CLI processes (run, ps, stop, serve): a second daemon, a daemon that died while
    starting, one that will not stop, or an error answer relayed from the daemon (`status` set)."""

    code = "daemon_error"

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status
