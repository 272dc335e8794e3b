"""Talking to one upstream: headers with its key, bounded reads, SSE events, errors mapped to ours.

Security: redirects are never followed (a 3xx is an error), so a request carrying the upstream's
key cannot be sent on to another host; every answer is read within settings'
upstream_max_response_bytes, and one streamed event within MAX_EVENT_BYTES. Messages an upstream
sends back are cut short, stripped of host paths and of the key before a client sees them.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

import aiohttp

from ...errors import (
    InvalidRequestError,
    LocalserveError,
    ModelNotFoundError,
    QueueFullError,
    UpstreamError,
    redact_paths,
)

if TYPE_CHECKING:
    from ...config.settings import Settings
    from .state import Upstream


class UpstreamPool(Protocol):
    """What these calls need of the pool (pool.py): its client session and the settings."""

    session: aiohttp.ClientSession | None
    settings: "Settings"

MAX_EVENT_BYTES = 1024 * 1024
MAX_MESSAGE_CHARS = 300
HEALTH_TIMEOUT_S = 5.0


class UpstreamFailed(Exception):
    """The upstream could not answer (connection, timeout, 5xx): worth another upstream. `reason`
    is safe to show and log."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def headers(upstream: "Upstream") -> dict[str, str]:
    out = {"Accept-Encoding": "identity"}
    if upstream.config.api_key:
        out["Authorization"] = f"Bearer {upstream.config.api_key}"
    return out


def clean(upstream: "Upstream", text: str) -> str:
    """An upstream's own words, made safe to show: no key, no host paths, short."""
    key = upstream.config.api_key
    if key:
        text = text.replace(key, "****")
    text = redact_paths(" ".join(text.split()))
    return text[:MAX_MESSAGE_CHARS] + ("..." if len(text) > MAX_MESSAGE_CHARS else "")


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    declared = response.content_length
    if declared is not None and declared > limit:
        raise UpstreamError(f"upstream answer too large ({declared} bytes; limit {limit})")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise UpstreamError(f"upstream answer too large (over {limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _message_of(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message")
        if isinstance(err, str):
            return err
    return ""


async def raise_for_status(upstream: "Upstream", response: aiohttp.ClientResponse) -> None:
    """Map a non-200 answer to our tree: 5xx -> UpstreamFailed (retry elsewhere), the rest to the
    error a client of ours would get for the same cause."""
    status = response.status
    if status == 200:
        return
    name = upstream.name
    if 300 <= status < 400:
        raise UpstreamError(f"upstream {name} answered a redirect ({status}); redirects are not followed")
    if status >= 500:
        raise UpstreamFailed(f"HTTP {status}")
    try:
        body = await read_bounded(response, 64 * 1024)
        detail = clean(upstream, _message_of(json.loads(body)))
    except (ValueError, LocalserveError, aiohttp.ClientError, asyncio.TimeoutError):
        detail = ""
    said = f"upstream {name}: {detail}" if detail else f"upstream {name} answered {status}"
    if status in (401, 403):
        raise UpstreamError(f"upstream {name} refused our credentials ({status}); check its api_key")
    if status == 404:
        raise ModelNotFoundError("", message=said)
    if status == 429:
        retry = response.headers.get("Retry-After", "")
        raise QueueFullError(said, retry_after=float(retry) if retry.isdigit() else 2.0)
    if status in (400, 413, 422):
        raise InvalidRequestError(said)
    raise UpstreamError(said)


def url_of(upstream: "Upstream", path: str) -> str:
    return upstream.config.url + path


@asynccontextmanager
async def post(pool: "UpstreamPool", upstream: "Upstream", path: str, body: dict[str, Any]
               ) -> AsyncIterator[aiohttp.ClientResponse]:
    """An open 200 response to POST `path`; UpstreamFailed when there is none to be had here."""
    assert pool.session is not None, "the upstream pool is not started"
    try:
        async with pool.session.post(url_of(upstream, path), json=body, headers=headers(upstream),
                                     allow_redirects=False) as response:
            await raise_for_status(upstream, response)
            yield response
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
        raise UpstreamFailed(_reason(e)) from None


async def get_json(pool: "UpstreamPool", upstream: "Upstream", path: str) -> Any:
    assert pool.session is not None, "the upstream pool is not started"
    try:
        async with pool.session.get(url_of(upstream, path), headers=headers(upstream), allow_redirects=False,
                                    timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
            if response.status != 200:
                raise UpstreamFailed(f"HTTP {response.status} on {path}")
            return json.loads(await read_bounded(response, pool.settings.upstream_max_response_bytes))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise UpstreamFailed(_reason(e)) from None
    except (ValueError, LocalserveError):
        raise UpstreamFailed(f"unreadable answer on {path}") from None


def _reason(e: BaseException) -> str:
    # The class name, not str(e): aiohttp's messages hold the URL, and a URL is the user's config.
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "connection refused or unreachable"
    return type(e).__name__


async def json_body(pool: "UpstreamPool", upstream: "Upstream", response: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = json.loads(await read_bounded(response, pool.settings.upstream_max_response_bytes))
    except ValueError:
        raise UpstreamError(f"upstream {upstream.name} sent an answer that is not JSON") from None
    if not isinstance(data, dict):
        raise UpstreamError(f"upstream {upstream.name} sent an unexpected answer")
    return data


async def sse_events(pool: "UpstreamPool", upstream: "Upstream", response: aiohttp.ClientResponse
                     ) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's `data:` lines, up to `data: [DONE]`."""
    buffer = b""
    total = 0
    limit = pool.settings.upstream_max_response_bytes
    async for chunk in response.content.iter_any():
        total += len(chunk)
        if total > limit:
            raise UpstreamError(f"upstream {upstream.name} streamed more than {limit} bytes")
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError:
                raise UpstreamError(f"upstream {upstream.name} sent an unreadable stream event") from None
            if isinstance(event, dict):
                yield event
        if len(buffer) > MAX_EVENT_BYTES:
            raise UpstreamError(f"upstream {upstream.name} sent a stream event over {MAX_EVENT_BYTES} bytes")
