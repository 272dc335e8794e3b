"""A small synchronous HTTP client over the daemon, for CLI commands (run, ps, stop).

The CLI reaches the daemon only over HTTP (docs/architecture.md). Synchronous on purpose: Ctrl-C lands as a
KeyboardInterrupt in the read loop, the generator's `finally` closes the socket, and the server sees
the disconnect and cancels the request at its next step -- no event loop to unwind in a terminal.
"""

from __future__ import annotations

import http.client
import json
import uuid
from typing import Any, Iterator
from urllib.parse import urlsplit

from ..errors import DaemonError

STREAM_TIMEOUT = 600.0  # a first request may wait for a model to load before the first byte


class DaemonClient:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 10.0):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise DaemonError(f"not a daemon URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._api_key = api_key
        self.timeout = timeout

    # --- plumbing --------------------------------------------------------------------------
    def _headers(self, body: bytes | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _open(
        self, method: str, path: str, body: Any = None, timeout: float | None = None, *,
        raw: bytes | None = None, content_type: str | None = None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode("utf-8")
        headers = self._headers(data)
        if content_type:
            headers["Content-Type"] = content_type
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout or self.timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise DaemonError(f"cannot reach the localserve daemon at {self.base_url}: {e}") from None
        except BaseException:
            conn.close()
            raise
        if resp.status >= 400:
            try:
                raise _error_from_response(resp)
            finally:
                conn.close()
        return conn, resp

    def request_bytes(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                      content_type: str | None = None) -> bytes:
        """The whole answer; `raw` + `content_type` send a body as it is (a multipart upload)."""
        conn, resp = self._open(method, path, body, raw=raw, content_type=content_type)
        try:
            return resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise DaemonError(f"the daemon at {self.base_url} closed the connection: {e}") from None
        finally:
            conn.close()

    def request_json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        raw = self.request_bytes(method, path, body, **kw)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise DaemonError(f"the daemon at {self.base_url} sent invalid JSON") from None

    def stream_sse(self, path: str, body: Any) -> Iterator[dict[str, Any]]:
        """POST and yield each `data:` JSON object of a server-sent event stream until `[DONE]`.
        Closing the generator (or an exception in the caller's loop) closes the connection."""
        conn, resp = self._open("POST", path, body, timeout=STREAM_TIMEOUT)
        try:
            while True:
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException) as e:
                    raise DaemonError(f"the stream from the daemon broke off: {e}") from None
                if not line:
                    raise DaemonError("the daemon closed the stream before it finished")
                text = line.decode("utf-8", errors="replace").strip()
                if not text.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                payload = text[len("data:"):].strip()
                if payload == "[DONE]":
                    return
                try:
                    event = json.loads(payload)
                except ValueError:
                    raise DaemonError("the daemon sent a malformed stream event") from None
                if isinstance(event, dict) and "error" in event:
                    raise DaemonError(_error_message(event))
                yield event
        finally:
            conn.close()

    # --- endpoints -------------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            conn, resp = self._open("GET", "/health")
        except DaemonError:
            return False
        try:
            resp.read()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()
        return True

    def ps(self) -> list[dict[str, Any]]:
        data = self.request_json("GET", "/api/ps")
        return list(data.get("models", [])) if isinstance(data, dict) else []

    def upload_file(self, filename: str, data: bytes, purpose: str = "batch") -> dict[str, Any]:
        """POST /v1/files as multipart/form-data (what OpenAI's clients send)."""
        boundary = f"localserve-{uuid.uuid4().hex}"
        safe_name = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
        form = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{safe_name}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n").encode("utf-8") + data + f"\r\n--{boundary}--\r\n".encode()
        return self.request_json("POST", "/v1/files", raw=form, content_type=f"multipart/form-data; boundary={boundary}")

    def chat_stream(self, model: str, messages: list[dict[str, str]], **options: Any) -> Iterator[str]:
        """Text deltas of a streamed chat completion (OpenAI endpoint)."""
        body = {"model": model, "messages": messages, "stream": True, **options}
        for event in self.stream_sse("/v1/chat/completions", body):
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    yield content


def _error_message(data: Any) -> str:
    """The message of an OpenAI (`{"error": {"message": ...}}`) or Ollama (`{"error": "..."}`) error body."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return "unknown error"


def _error_from_response(resp: http.client.HTTPResponse) -> DaemonError:
    try:
        message = _error_message(json.loads(resp.read() or b"null"))
    except (ValueError, OSError, http.client.HTTPException):
        message = "unknown error"
    if message == "unknown error":
        message = f"HTTP {resp.status} {resp.reason}"
    return DaemonError(message, status=resp.status)
