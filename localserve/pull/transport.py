"""How a download reaches the network: the injectable `Transport`, urllib's (redirects that keep
the Hub token on its own origin, a hook on every connection for cancellation and the link policy)
and the one that adds the Hub token.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from typing import Mapping, Protocol
from urllib.parse import urlparse

from .. import __version__
from .cancel import CancelToken
from .policy import UrlPolicy

USER_AGENT = f"localserve/{__version__}"


class Response(Protocol):
    status: int
    headers: Mapping[str, str]

    def read(self, n: int = -1) -> bytes: ...

    def close(self) -> None: ...


class Transport(Protocol):
    def open(self, url: str, headers: Mapping[str, str]) -> Response: ...


def origin_of(url: str) -> tuple[str, str, int | None]:
    parsed = urlparse(url)
    return parsed.scheme.lower(), (parsed.hostname or "").lower(), parsed.port


class _SameOriginAuthRedirects(urllib.request.HTTPRedirectHandler):
    """urllib copies every ordinary header onto a redirected request, whatever its host. A Hub
    token must not follow the Hub's redirect to its CDN (or to anywhere else a redirect points), so
    Authorization travels as an "unredirected" header and is put back only when the redirect stays
    on the origin it was sent to (a renamed repository redirects within the Hub). With a UrlPolicy,
    every redirect target must pass it (a public https link may redirect to http://127.0.0.1)."""

    def __init__(self, policy: UrlPolicy | None = None):
        super().__init__()
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if self.policy is not None:
            self.policy.check_url(newurl)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        auth = req.unredirected_hdrs.get("Authorization")
        if new is not None and auth and origin_of(newurl) == origin_of(req.full_url):
            new.add_unredirected_header("Authorization", auth)
        return new


class _ConnectHook:
    """Runs on every new connection of a transport: registers its socket with the CancelToken and
    checks the address it reached against the UrlPolicy (skipped through a proxy, which the user
    configured and whose address is not the link's)."""

    def __init__(self, policy: UrlPolicy | None, cancel: CancelToken | None):
        self.policy, self.cancel = policy, cancel

    def connected(self, connection: http.client.HTTPConnection, req: urllib.request.Request) -> None:
        sock = connection.sock
        if self.cancel is not None:
            self.cancel.attach(sock)
        proxied = req.has_proxy() or getattr(req, "_tunnel_host", None)
        if self.policy is not None and not proxied:
            self.policy.check_peer(urlparse(req.full_url).hostname or "", sock.getpeername()[0])


class _HookedHandlerMixin:
    hook: _ConnectHook

    def do_open(self, http_class, req, **kwargs):  # type: ignore[no-untyped-def]
        hook = self.hook

        class Connection(http_class):  # type: ignore[misc,valid-type]
            def connect(self) -> None:
                super().connect()
                hook.connected(self, req)

        return super().do_open(Connection, req, **kwargs)  # type: ignore[misc]


class _HookedHTTPHandler(_HookedHandlerMixin, urllib.request.HTTPHandler):
    def __init__(self, hook: _ConnectHook):
        super().__init__()
        self.hook = hook


class _HookedHTTPSHandler(_HookedHandlerMixin, urllib.request.HTTPSHandler):
    def __init__(self, hook: _ConnectHook):
        super().__init__()
        self.hook = hook


class UrllibTransport:
    """HTTP(S) through urllib: follows redirects (the Hub's resolve links redirect to a CDN; urllib
    keeps the Range header on the redirected request, but not Authorization when the redirect
    leaves the origin), honours proxy environment variables. `timeout` bounds each socket wait,
    which makes it the stall timeout of a body (None: wait forever); `policy` and `cancel` see
    every connection."""

    def __init__(self, timeout: float | None = 30.0, *, policy: UrlPolicy | None = None,
                 cancel: CancelToken | None = None):
        self.timeout = timeout
        hook = _ConnectHook(policy, cancel)
        self._opener = urllib.request.build_opener(
            _SameOriginAuthRedirects(policy), _HookedHTTPHandler(hook), _HookedHTTPSHandler(hook))

    def open(self, url: str, headers: Mapping[str, str]) -> Response:
        plain = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **plain})
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), None)
        if auth:
            request.add_unredirected_header("Authorization", auth)
        try:
            return self._opener.open(request, timeout=self.timeout)  # type: ignore[no-any-return]
        except urllib.error.HTTPError as e:
            return e  # type: ignore[return-value]  # carries status, headers and body like a response


class BearerTransport:
    """Adds `Authorization: Bearer <token>` to the requests for one origin (the Hub's, for gated
    and private repositories) and to no other."""

    def __init__(self, inner: Transport, origin_url: str, token: str):
        self.inner = inner
        self.origin = origin_of(origin_url)
        self._header = f"Bearer {token}"

    def open(self, url: str, headers: Mapping[str, str]) -> Response:
        if origin_of(url) == self.origin:
            headers = {**headers, "Authorization": self._header}
        return self.inner.open(url, headers)
