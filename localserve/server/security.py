"""Who may talk to the daemon: Host check (DNS rebinding), CORS allow-list, optional API key.

A server on 127.0.0.1 is reachable by every web page the user opens: a page on evil.example whose
DNS name is re-pointed at 127.0.0.1 sends requests with `Host: evil.example` (DNS rebinding), and
any page can fire cross-origin requests whose answers the browser hides from it unless we grant
CORS. So: a Host header that is not a local name is refused with 403 before anything else runs;
CORS is granted only to origins on the allow-list (localhost pages and editor webviews), and a
request from any other web origin is refused outright (CSRF: a cross-site form POST needs no CORS
to have side effects); and an
API key, when configured, is compared in constant time so its bytes cannot be guessed by timing.

Preflights: an allowed origin gets back exactly the header names it asked for, because browser SDKs
send headers no fixed list foresees (the `openai` npm package sends eight `X-Stainless-*` ones).
A list that is not a list of header names (RFC 9110 tokens, at most MAX_PREFLIGHT_HEADERS of at
most MAX_HEADER_NAME_LEN characters) is refused with 403 and no grant, as a foreign origin's
preflight is. The grant always names the origin, never `*`, and never includes
Access-Control-Allow-Credentials: the API key travels in a header, which needs no credentials mode.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from typing import Iterable

from aiohttp import web

from ..config.settings import Settings
from .errors import Handler, error_response
from .state import SETTINGS_KEY

# Paths answered without the API key (but never without the Host check): liveness probes from
# tray apps and service managers that do not know the key.
KEY_EXEMPT_PATHS = frozenset({"/health"})
# The dashboard's page and its files (server/dashboard_routes.py): a browser loads them by
# navigation, which cannot send a key; they hold no data, and every call the page makes carries it.
KEY_EXEMPT_PAGES = ("/", "/dashboard/")
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# A field name is an RFC 9110 token; the bounds are far above what any client sends (the openai
# SDK asks for about ten) and keep a hostile list from being echoed back at length.
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
MAX_PREFLIGHT_HEADERS = 64
MAX_HEADER_NAME_LEN = 128


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


def requested_headers(value: str) -> list[str] | None:
    """The names in an Access-Control-Request-Headers value, or None when it is not a sane list of
    header names. Empty items are skipped, as RFC 9110 asks of list recipients."""
    names = [name.strip() for name in value.split(",")]
    names = [name for name in names if name]
    if len(names) > MAX_PREFLIGHT_HEADERS:
        return None
    if any(len(name) > MAX_HEADER_NAME_LEN or not HEADER_NAME.fullmatch(name) for name in names):
        return None
    return names


def is_page(path: str) -> bool:
    return path == KEY_EXEMPT_PAGES[0] or path.startswith(KEY_EXEMPT_PAGES[1])


def is_preflight(request: web.Request) -> bool:
    headers = request.headers
    return request.method == "OPTIONS" and bool(headers.get("Origin")) and bool(headers.get("Access-Control-Request-Method"))


def origin_refused(request: web.Request) -> web.Response:
    return error_response(
        request, 403, "origin not allowed (add it to cors_origins to let that page use the API)",
        "permission_error", code="origin_not_allowed",
    )


def preflight_response(request: web.Request, allowed_origin: bool) -> web.Response:
    """The answer to a CORS preflight; the Access-Control-Allow-Origin grant itself is added by
    add_cors_headers, like on every other response."""
    if not allowed_origin:
        return origin_refused(request)
    names = requested_headers(request.headers.get("Access-Control-Request-Headers", ""))
    if names is None:
        return error_response(
            request, 403, "preflight refused: Access-Control-Request-Headers is not a list of header names",
            "permission_error", code="headers_not_allowed",
        )
    response = web.Response(status=204)
    response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
    if names:
        response.headers["Access-Control-Allow-Headers"] = ", ".join(names)
    response.headers["Access-Control-Max-Age"] = "600"
    # The answer depends on these request headers: a cache must not hand it to another preflight.
    response.headers["Vary"] = "Access-Control-Request-Headers, Access-Control-Request-Method"
    return response


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
        if is_preflight(request):
            # A preflight: answered here, without the key (browsers never send credentials on it).
            return preflight_response(request, allowed_origin)
        if not allowed_origin:
            # Withholding CORS only hides the answer from a foreign page; a "simple" cross-site POST
            # (text/plain body, no preflight) would still run: generate, pull or delete models.
            # Browsers always send Origin on such requests, non-browser clients do not.
            return origin_refused(request)
        if settings.api_key and request.path not in KEY_EXEMPT_PATHS and not is_page(request.path):
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
    # Every answer depends on Origin (granted, refused, or none asked), so every one says so: a
    # cache must not serve one origin's answer to another.
    vary = response.headers.get("Vary")
    response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
    # A refused preflight (any answer but the 204) gets no grant, whoever asked.
    refused_preflight = is_preflight(request) and response.status != 204
    if origin and not refused_preflight and origin_allowed(origin, settings.cors_origins):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"

