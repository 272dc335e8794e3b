"""`id_slot` on /infill and /completion: a client's next request supersedes its last one.

llama.vim and llama.vscode send `id_slot` (0) with their completions. llama-server pins the request
to that slot and makes it wait for the slot's previous request; when that previous request is the
same editor's (llama.vscode's speculative "next line" request still running when the next
keystroke's comes), it has no use for that answer any more, so here the newer request ends the
older one instead: the older one answers `RequestSupersededError` (409) and its sequence is
cancelled before the newer one is submitted, so the engine parks the older one's cells in the
prefix cache at its next step and the newer one, sharing the file's start, reuses them.

Only the same client supersedes (issue 49 #10: keyed by User-Agent alone, two VS Code windows, or
any two local programs on one HTTP library, ended each other's completions). The same client is
the same User-Agent from the same process: each request in flight has a TCP connection of its own
(HTTP/1.1 answers one request at a time per connection, so "the same connection" never holds two),
and on loopback every peer is 127.0.0.1, so the peer's address says nothing either; the process
that owns the client's end of the connection does. The OS's socket table names it (psutil), looked
up only when a claim for the same model, slot and User-Agent is already held. Where the owner
cannot be known (a remote client, another account's process on Linux, macOS without root) the
two requests are not proven to be one client's, and both run, as two slots would: nobody's
completion is ended by a stranger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterable

import psutil

from ..errors import RequestSupersededError

log = logging.getLogger("localserve.server")

# How long a new request waits for the one it superseded to let go of its stream. Ending a
# stream is a cancel message and a few awaits; a holder stuck longer than this only costs the new
# request its cache reuse.
RELEASE_WAIT_S = 1.0

Address = tuple[str, int]


@dataclass(frozen=True)
class Client:
    """Who sent a request: its User-Agent and the two ends of its TCP connection."""

    user_agent: str
    peer: Address | None  # the client's end, as we see it
    local: Address | None  # ours


@dataclass
class SlotClaim:
    slot: int
    client: Client
    superseded: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


def connection_owners(clients: Iterable[Client]) -> dict[Client, int]:
    """The process owning each client's end of its connection, for those the OS names. Blocking
    (a walk of every process's sockets on Linux, tens of ms): run it in a thread."""
    wanted = {(c.peer, c.local): c for c in clients if c.peer and c.local}
    if not wanted:
        return {}
    try:
        table = psutil.net_connections("tcp")
    except (psutil.Error, OSError):  # macOS refuses it without root
        return {}
    owners = {}
    for conn in table:
        if conn.pid is not None and conn.laddr and conn.raddr:
            client = wanted.get(((conn.laddr[0], conn.laddr[1]), (conn.raddr[0], conn.raddr[1])))
            if client is not None:
                owners[client] = conn.pid
    return owners


class SlotClaims:
    """The requests holding each (model, id_slot, User-Agent); one per daemon (server/state.SLOTS_KEY)."""

    def __init__(self, owners: Callable[[Iterable[Client]], dict[Client, int]] = connection_owners) -> None:
        self._holders: dict[tuple[str, int, str], list[SlotClaim]] = {}
        self._owners = owners

    @contextlib.asynccontextmanager
    async def claim(self, model: str, slot: int | None, client: Client) -> AsyncIterator[SlotClaim | None]:
        """Hold `slot` for the body of the block, after ending the same client's previous holder;
        None (no claim) when the request named no slot."""
        if slot is None:
            yield None
            return
        key = (model, slot, client.user_agent)
        mine = SlotClaim(slot, client)
        holders = self._holders.setdefault(key, [])
        others = list(holders)
        holders.append(mine)  # before any await: a request after this one sees it
        try:
            for previous in await self._same_client(mine, others):
                previous.superseded.set()
                try:
                    await asyncio.wait_for(previous.released.wait(), RELEASE_WAIT_S)
                except asyncio.TimeoutError:
                    log.info("id_slot %d of %s: the superseded request did not end within %.0f s", slot, model,
                             RELEASE_WAIT_S)
            if mine.superseded.is_set():  # a third request came while this one waited
                raise RequestSupersededError(slot)
            yield mine
        finally:
            mine.released.set()
            holders.remove(mine)
            if not holders and self._holders.get(key) is holders:
                del self._holders[key]

    async def _same_client(self, mine: SlotClaim, others: list[SlotClaim]) -> list[SlotClaim]:
        """The claims among `others` whose connection the same process owns as `mine`'s."""
        others = [c for c in others if not c.released.is_set()]
        if not others:
            return []
        owners = await asyncio.to_thread(self._owners, [mine.client, *(c.client for c in others)])
        me = owners.get(mine.client)
        return [c for c in others if me is not None and owners.get(c.client) == me]
