"""A loaded model and the leases that keep it loaded.

Every request holds a `Lease` on its model while it runs (`ModelManager.use`): a model with a lease
is never unloaded, neither by keep-alive nor by a swap. A lease knows its lane, so the swap policy
(swaps.py) can tell batch-lane work, which a better-lane request for another model may end at a
step boundary, from work nothing may abort. The Batch API's hold between lines (`hold`) keeps the
model loaded for the batch but is no work: a swap revokes it, and the batch takes a new one when its
next line runs, after the swap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ..protocol.engine import EventStream, ModelEngine
from ..protocol.requests import Lane

if TYPE_CHECKING:
    from ..store.cache import InstalledModel


@dataclass(eq=False)
class LoadedModel:
    name: str  # "name:tag"
    engine: ModelEngine
    info: "InstalledModel | None"  # None for a remote model (served by upstreams, nothing loaded here)
    loaded_at: float  # epoch seconds
    memory_bytes: int
    device: str = "cpu"
    vram_bytes: int = 0
    expires_at: float | None = None  # epoch seconds; None while leased or when kept forever
    keep_alive: float = 300.0
    leases: set["Lease"] = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)
    resident_since: float = field(default_factory=time.monotonic)  # for the thrash guard
    unload_when_idle: bool = False
    # Set while it makes room for a waiting request of that lane (swaps.make_room): it admits only
    # better lanes, and unloads when its last working lease ends.
    draining_for: Lane | None = None
    making_room_for: str | None = None  # the model it drains for
    served: bool = False  # a request got a lease since the load (its wait is logged once)

    @property
    def pinned(self) -> int:
        return len(self.leases)

    def revoke_holds(self) -> None:
        """It goes (unloaded, or its worker died): a batch's hold is no work, so it is taken back,
        and the batch takes a new lease when its next line runs."""
        for lease in [lease for lease in self.leases if lease.hold]:
            lease.preempted = True
            self.leases.discard(lease)

    @property
    def work(self) -> tuple[str, ...]:
        """The lane of every lease doing work (a hold is none)."""
        return tuple(lease.lane for lease in self.leases if not lease.hold)


@dataclass(eq=False)
class Lease:
    """One request's (or one batch's hold of) a loaded model. `name`, `engine` and `info` are the
    model's, so callers read `lease.engine` as they read a loaded model."""

    model: LoadedModel
    lane: Lane = "default"
    hold: bool = False
    streams: list[EventStream] = field(default_factory=list)
    preempted: bool = False  # its batch-lane work was ended so that another model can load
    released: bool = False

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def engine(self) -> ModelEngine:
        return self.model.engine

    @property
    def info(self) -> "InstalledModel | None":
        return self.model.info

    @property
    def revoked(self) -> bool:
        """A hold a swap took back (or any lease already given back): the holder must lease anew."""
        return self.released or self.preempted

    def attach(self, streams: Sequence[EventStream]) -> None:
        """The lease's requests in the engine, so a swap can end them (a preempted lease ends them at once)."""
        self.streams.extend(streams)
        if self.preempted:
            self.preempt()

    def preempt(self) -> None:
        """End this lease's work at the engine's next step boundary (the streams end "cancelled")."""
        self.preempted = True
        for stream in self.streams:
            stream.cancel()
