"""`id_slot` on /infill and /completion: a client's next request supersedes its last one.

llama.vim and llama.vscode send `id_slot` with every completion, one request per keystroke burst.
llama-server pins the request to that slot and makes it wait for the slot's previous request; an
editor has no use for that answer any more (the cursor moved), so here the newer request ends the
older one instead: the older one answers `RequestSupersededError` (409) and its sequence is
cancelled before the newer one is submitted, so the engine parks the older one's cells in the
prefix cache at its next step and the newer one, sharing the file's start, reuses them.

A claim is keyed by model, slot and User-Agent: two editors that both send `id_slot: 0` do not end
each other's completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..errors import RequestSupersededError

log = logging.getLogger("localserve.server")

# How long a new request waits for the one it superseded to let go of its stream. Ending a
# stream is a cancel message and a few awaits; a holder stuck longer than this only costs the new
# request its cache reuse.
RELEASE_WAIT_S = 1.0

SlotKey = tuple[str, int, str]


@dataclass
class SlotClaim:
    slot: int
    superseded: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class SlotClaims:
    """The request holding each (model, id_slot, client); one per daemon (server/state.SLOTS_KEY)."""

    def __init__(self) -> None:
        self._holders: dict[SlotKey, SlotClaim] = {}

    @contextlib.asynccontextmanager
    async def claim(self, model: str, slot: int | None, client: str) -> AsyncIterator[SlotClaim | None]:
        """Hold `slot` for the body of the block, after ending its previous holder; None (no claim)
        when the request named no slot."""
        if slot is None:
            yield None
            return
        key = (model, slot, client)
        mine = SlotClaim(slot)
        previous = self._holders.get(key)
        self._holders[key] = mine
        try:
            if previous is not None:
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
            if self._holders.get(key) is mine:
                del self._holders[key]
