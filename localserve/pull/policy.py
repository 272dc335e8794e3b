"""Which links a pull requested over the HTTP API may fetch.

/api/pull answers every local process (and, on a non-loopback bind, API-key holders on the
network). Without a rule it would fetch from any address the daemon reaches, and its errors would
tell the caller which local ports are open. So a link a client chose must be https to a public
address, except hosts the user listed in `pull_allow_http_hosts` (a LAN mirror, a test server).
The rule is checked on the link before anything is sent, on every redirect, and on the address
each connection really reached (a public name may resolve to 127.0.0.1).

Image URLs in a chat request (api/image_fetch.py) are fetched under the same rule, for the same
reason: the policy then names the image's field and speaks of images, not pulls.

`localserve pull URL` does not apply it: there the user types the link themself, with their own
network access, and the rule would only stop them using their own mirror. Links from the user's
catalog and the configured Hub endpoint are the user's configuration, so they are not checked
either.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlparse

from ..config.settings import Settings
from ..errors import InvalidRequestError

# Worded without "refused" or "connect": a client must not confuse a policy answer with a port probe.
HTTP_REFUSED_OF = ("{what} over http:// are not allowed; use an https:// link, or add the host to "
                   "pull_allow_http_hosts")
LOCAL_REFUSED_OF = ("{what} from loopback, private or link-local addresses are not allowed; add the host to "
                    "pull_allow_http_hosts to allow it")
HTTP_REFUSED = HTTP_REFUSED_OF.format(what="pulls")
LOCAL_REFUSED = LOCAL_REFUSED_OF.format(what="pulls")


def is_direct_link(ref: str) -> bool:
    """A `/api/pull` reference that names a download link (not a catalog name or `hf.co/...`)."""
    from ..store.catalog import is_hf_ref

    text = ref.strip()
    return text.lower().startswith(("https://", "http://")) and not is_hf_ref(text)


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback, though IPv6Address does not say so
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class UrlPolicy:
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)
    param: str = "model"  # the field a refusal names
    what: str = "pulls"  # what a refusal says is not allowed

    @classmethod
    def from_settings(cls, settings: Settings, *, param: str = "model", what: str = "pulls") -> "UrlPolicy":
        return cls(frozenset(h.strip().strip("[]").lower() for h in settings.pull_allow_http_hosts), param, what)

    def _refused(self, template: str) -> InvalidRequestError:
        return InvalidRequestError(template.format(what=self.what), param=self.param)

    def _allowed(self, host: str) -> bool:
        return host.lower() in self.allowed_hosts

    def check_url(self, url: str) -> None:
        """Refuse a link (or a redirect target) by its scheme and host, before connecting."""
        parsed = urlparse(url)
        host = (parsed.hostname or "").lower()
        if parsed.scheme.lower() not in ("http", "https") or not host:
            raise InvalidRequestError(f"{self.what} need an https:// URL", param=self.param)
        if self._allowed(host):
            return
        if parsed.scheme.lower() != "https":
            raise self._refused(HTTP_REFUSED_OF)
        if host == "localhost" or host.endswith(".localhost"):
            raise self._refused(LOCAL_REFUSED_OF)
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            return  # a name: its address is checked once connected (check_peer)
        if not _is_public(literal):
            raise self._refused(LOCAL_REFUSED_OF)

    def check_peer(self, host: str, address: str) -> None:
        """Refuse a connection that reached a non-public address for a host not allowed."""
        if self._allowed(host):
            return
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
        except ValueError:
            raise self._refused(LOCAL_REFUSED_OF) from None  # not an IP socket at all
        if not _is_public(ip):
            raise self._refused(LOCAL_REFUSED_OF)
