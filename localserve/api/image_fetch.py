"""An image URL fetched for a request (OpenAI `image_url`, Responses `input_image`, Anthropic's
`url` source), under /api/pull's link policy (pull/policy.py): https to a public address unless
the host is in `pull_allow_http_hosts`, checked on the link, on every redirect and on the address
each connection reached, so a request cannot make the daemon probe the user's network. Bounded in
bytes (the request's image bytes left: a Content-Length over them is refused unread, a body that
grows past them is cut off) and in time (`image_fetch_timeout` for the whole body, not per read:
a server trickling a byte a second would otherwise hold the request forever).

Blocking (urllib): callers run it in a worker thread (api/images.py).
"""

from __future__ import annotations

import http.client
import time
import urllib.error
from dataclasses import replace

from ..pull.policy import UrlPolicy
from ..pull.transport import UrllibTransport
from .image_checks import refused

READ_CHUNK = 64 * 1024


def fetch_image(url: str, param: str, policy: UrlPolicy, *, max_bytes: int, timeout: float) -> bytes:
    """The body at `url`, or a 400 naming `param`."""
    policy = replace(policy, param=param)
    policy.check_url(url)
    deadline = time.monotonic() + timeout
    transport = UrllibTransport(timeout=timeout, policy=policy)
    try:
        response = transport.open(url, {"Accept": "image/*"})
    except (OSError, http.client.HTTPException, ValueError):
        # No reason given: "connection refused" against "timed out" would tell a client which
        # ports are open on a host whose name resolves to a private address (checked only once
        # connected), the port probe the policy exists to stop.
        raise refused(param, "could not be fetched (no connection to its host, or no answer)") from None
    try:
        if response.status != 200:
            raise refused(param, f"could not be fetched (the server answered HTTP {response.status})")
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise refused(param, f"is {declared} bytes, more than the {max_bytes} this request's images may "
                                  "have left (setting max_image_bytes)")
        return _read_bounded(response, param, max_bytes, deadline, timeout)
    finally:
        response.close()


def _read_bounded(response, param: str, max_bytes: int, deadline: float, timeout: float) -> bytes:  # type: ignore[no-untyped-def]
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:
            raise refused(param, f"did not arrive within {timeout:g} seconds (setting image_fetch_timeout)")
        try:
            chunk = response.read(READ_CHUNK)
        except TimeoutError:
            raise refused(param, f"did not arrive within {timeout:g} seconds (setting image_fetch_timeout)") from None
        except (OSError, http.client.HTTPException, urllib.error.URLError):
            raise refused(param, "could not be fetched (the connection failed while reading)") from None
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise refused(param, f"is more than the {max_bytes} bytes this request's images may have left "
                                  "(setting max_image_bytes)")
        chunks.append(chunk)
