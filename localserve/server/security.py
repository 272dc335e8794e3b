"""Who may talk to the daemon: Host check (DNS rebinding), CORS allow-list, optional API key.

A server on 127.0.0.1 is reachable by every web page the user opens: a page on evil.example whose
DNS name is re-pointed at 127.0.0.1 sends requests with `Host: evil.example` (DNS rebinding), and
any page can fire cross-origin requests whose answers the browser hides from it unless we grant
CORS. So: a Host header that is not a local name is refused with 403 before anything else runs;
CORS is granted only to origins on the allow-list (localhost pages and editor webviews), and a
request from any other web origin is refused outright (CSRF: a cross-site form POST needs no CORS
to have side effects); and an
API key, when configured, is compared in constant time so its bytes cannot be guessed by timing.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Iterable

from aiohttp import web

from ..config import Settings
from .errors import Handler, error_response
from .state import SETTINGS_KEY

# Paths answered without the API key (but never without the Host check): liveness probes from
# tray apps and service managers that do not know the key.
KEY_EXEMPT_PATHS = frozenset({"/health"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Priority, X-Requested-With, OpenAI-Organization, OpenAI-Project"


def split_host(host_header: str) -> str:
    """The host part of a Host header value: `[::1]:8080` -> `::1`, `Localhost.:80` -> `localhost`."""
    host = host_header.strip()
    if host.startswith("["):
        end = host.find("]")
        host = host[1:end] if end > 0 else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".").lower()


def is_local_host(host: str, bind_host: str = "127.0.0.1") -> bool:
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    if bind_host and bind_host not in WILDCARD_HOSTS and host == bind_host.lower():
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str, allow_list: Iterable[str]) -> bool:
    """`http://localhost` allows that origin with any port, but not `http://localhost.evil.example`;
    entries ending in `://` (editor webviews) allow the whole scheme."""
    origin = origin.strip().lower()
    for entry in allow_list:
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        if entry.endswith("://"):
            if origin.startswith(entry):
                return True
            continue
        if origin == entry or (origin.startswith(entry + ":") and origin[len(entry) + 1 :].isdigit()):
            return True
    return False


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("X-Api-Key")


def key_matches(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


def security_middleware(settings: Settings):
    """The outermost middleware: it also answers CORS preflights, which never reach a handler."""
    # With a wildcard bind and an API key the user asked for remote access by whatever name the
    # machine has; the key (which a rebinding page cannot know) then carries the protection.
    any_host = settings.host in WILDCARD_HOSTS and bool(settings.api_key)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        host_header = request.headers.get("Host", "")
        if not any_host and not is_local_host(split_host(host_header), settings.host):
            return error_response(
                request, 403, "host not allowed: the server answers local names only", "permission_error",
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        allowed_origin = origin is None or origin_allowed(origin, settings.cors_origins)
        if request.method == "OPTIONS" and origin and request.headers.get("Access-Control-Request-Method"):
            # A preflight: answered here, without the key (browsers never send credentials on it).
            response = web.Response(status=204)
            if allowed_origin:
                response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
                response.headers["Access-Control-Allow-Headers"] = ALLOWED_HEADERS
                response.headers["Access-Control-Max-Age"] = "600"
            return response
        if not allowed_origin:
            # Withholding CORS only hides the answer from a foreign page; a "simple" cross-site POST
            # (text/plain body, no preflight) would still run: generate, pull or delete models.
            # Browsers always send Origin on such requests, non-browser clients do not.
            return error_response(
                request, 403, "origin not allowed (add it to cors_origins to let that page use the API)",
                "permission_error", code="origin_not_allowed",
            )
        if settings.api_key and request.path not in KEY_EXEMPT_PATHS:
            if not key_matches(presented_key(request), settings.api_key):
                return error_response(
                    request, 401, "invalid or missing API key (send Authorization: Bearer <key> or X-Api-Key)",
                    "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return middleware


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: runs for every response, streaming ones included, just before the
    headers go out (a middleware would be too late for an SSE response it did not create)."""
    origin = request.headers.get("Origin")
    settings: Settings = request.app[SETTINGS_KEY]
    if origin and origin_allowed(origin, settings.cors_origins):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        vary = response.headers.get("Vary")
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"

