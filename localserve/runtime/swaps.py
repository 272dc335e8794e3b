"""The swap policy: who waits for a load, which loaded model makes room, and when.

A request for a model that is not loaded, and does not fit beside the loaded ones, waits in its lane
(`LoadQueues`: the lane's `queue_size` bound, 429 + Retry-After past it; `queue_timeout`, then 503),
exactly as a request waits in a loaded engine's lane. The best waiting request (lane first, then
arrival) decides what makes room (`make_room`), cheapest first:

1. **idle** models (no request running; a batch's hold between lines is no work) go at once, least
   recently used first;
2. models whose only work is **batch-lane** requests, for a better-lane waiter: that work is ended
   at the engine's next step boundary with `SwapPreemptedError`, which the Batch API runner answers
   by running the line again after the swap (each `custom_id` is still written once);
3. models resident for at least their **minimum residency** (`swap_min_residency`) **drain**: they
   admit no new request of the waiter's lane or a worse one, finish everything they run (nothing in
   flight is ever aborted), and unload when the last request ends;
4. a model loaded less than its minimum residency ago and still working keeps its slot until then:
   the thrash guard. Without it two busy models on a one-model machine would swap on every
   request, spending the machine on loads instead of answers.

Nothing here touches an engine: the manager (`manager.py`) feeds the policy a snapshot of its
residents and waiters and applies the decision.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..errors import QueueFullError
from ..protocol.requests import LANE_RANK, LANES

if TYPE_CHECKING:
    from ..store.cache import InstalledModel

PREEMPTIBLE_LANE = "batch"  # the only lane whose in-flight work a swap may end (and the runner redoes)
DEFAULT_RETRY_AFTER = 5.0  # Retry-After for a full load queue before any load of the model was timed


def outranks(lane: str, other: str) -> bool:
    """`lane` is strictly better than `other` (interactive > default > batch)."""
    return LANE_RANK[lane] < LANE_RANK[other]


@dataclass(frozen=True)
class Resident:
    """A loaded (or loading) model as the policy sees it."""

    name: str
    memory_bytes: int
    loaded_at: float  # time.monotonic()
    last_used: float  # time.monotonic()
    work: tuple[str, ...]  # the lane of every request it runs (holds are no work)
    loading: bool = False  # still loading: it cannot make room for anyone

    def guarded_until(self, min_residency: float) -> float:
        return self.loaded_at + min_residency


@dataclass
class Room:
    """Whether models fit together: a count bound (0 = none) and a memory budget. A model larger
    than the budget still loads when nothing else is loaded (llama.cpp maps weights from disk)."""

    budget_bytes: int
    max_models: int = 0
    freeing: int = 0  # models still unloading: they count until their memory is back
    freeing_bytes: int = 0

    def fits(self, residents: Iterable[Resident], needed: int) -> bool:
        residents = list(residents)
        if self.max_models and len(residents) + self.freeing >= self.max_models:
            return False
        used = sum(r.memory_bytes for r in residents) + self.freeing_bytes
        return used + needed <= self.budget_bytes or (not residents and not self.freeing)


@dataclass
class Eviction:
    """What to do so that one more model fits. `ready` when, once `unload` is done, it fits;
    otherwise `drain` (and `preempt`) models are on their way out and `recheck_at` (monotonic) is
    when a guarded model's minimum residency ends."""

    unload: list[str] = field(default_factory=list)  # idle: unload now
    preempt: list[str] = field(default_factory=list)  # end their batch-lane work now, then unload
    drain: list[str] = field(default_factory=list)  # admit nothing new of the lane, unload when drained
    guarded: list[str] = field(default_factory=list)  # would have to go, but are within their minimum residency
    recheck_at: float | None = None
    ready: bool = False


def make_room(residents: list[Resident], needed: int, room: Room, lane: str, *, min_residency: float,
              now: float | None = None) -> Eviction:
    """The cheapest way to fit a model of `needed` bytes for a request of `lane` (module docstring)."""
    now = time.monotonic() if now is None else now
    if room.fits(residents, needed):
        return Eviction(ready=True)

    def cost(r: Resident) -> tuple[int, float]:
        if not r.work:
            return 0, r.last_used
        if outranks(lane, PREEMPTIBLE_LANE) and all(w == PREEMPTIBLE_LANE for w in r.work):
            return 1, r.last_used
        if now >= r.guarded_until(min_residency):
            return 2, r.last_used
        return 3, r.guarded_until(min_residency)

    remaining = list(residents)
    out = Eviction()
    for r in sorted((r for r in residents if not r.loading), key=cost):
        remaining.remove(r)
        kind = cost(r)[0]
        [out.unload, out.preempt, out.drain, out.guarded][kind].append(r.name)
        if room.fits(remaining, needed):
            break
    else:
        return Eviction()  # it fits only once the models still loading (or unloading) are done
    if out.guarded:
        # Some must stay for now: start nothing that would be wasted if the plan changes meanwhile.
        ends = [r.guarded_until(min_residency) for r in residents if r.name in out.guarded]
        return Eviction(guarded=out.guarded, recheck_at=max(ends))
    out.ready = not out.preempt and not out.drain
    return out


def admits(draining_for: str | None, lane: str) -> bool:
    """A loaded model draining for a waiter of lane `draining_for` still admits better lanes."""
    return draining_for is None or outranks(lane, draining_for)


# --- the queue of requests waiting for a load ---------------------------------------------------
_ORDER = itertools.count()


@dataclass(eq=False)
class Waiter:
    """One request waiting for its model to be loaded (or to admit it again)."""

    model: str
    lane: str
    installed: "InstalledModel"
    needed: int  # the model's planned memory
    hold: bool = False
    plan: Any = None  # planning.ModelPlan: what its load is given
    since: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_ORDER))
    reason: str = ""
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def key(self) -> tuple[int, int]:
        return LANE_RANK[self.lane], self.order

    def grant(self, lease: Any) -> bool:
        """Hand it its lease; False when it already gave up (timed out, client gone)."""
        if self.future.done():
            return False
        self.future.set_result(lease)
        return True

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class LoadQueues:
    """Requests waiting for a load, bounded per model and lane by the lane's queue size: the same
    bound a loaded engine puts on its lane, so a model's clients see one queue whether it is loaded
    or not."""

    def __init__(self, queue_size: int, retry_after: Callable[[str], float]):
        self.queue_size = queue_size
        self._retry_after = retry_after
        self._waiters: list[Waiter] = []

    def add(self, waiter: Waiter) -> Waiter:
        queued = sum(1 for w in self._waiters if w.model == waiter.model and w.lane == waiter.lane)
        if self.queue_size and queued >= self.queue_size:
            raise QueueFullError(
                f"the {waiter.lane} lane of {waiter.model} is full ({queued} requests waiting for it to load)",
                retry_after=self._retry_after(waiter.model))
        self._waiters.append(waiter)
        return waiter

    def discard(self, waiter: Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def ordered(self) -> list[Waiter]:
        """Best first: lane, then arrival. Finished ones (granted, failed, abandoned) are dropped."""
        self._waiters = [w for w in self._waiters if not w.future.done()]
        return sorted(self._waiters, key=lambda w: w.key)

    def fail_all(self, error_for: Callable[[Waiter], BaseException], model: str | None = None) -> None:
        for w in self.ordered():
            if model is None or w.model == model:
                w.fail(error_for(w))

    def rows(self) -> list[dict[str, Any]]:
        """One status row per model with waiting requests: counts per lane, the longest wait, why."""
        now = time.monotonic()
        by_model: dict[str, list[Waiter]] = {}
        for w in self.ordered():
            by_model.setdefault(w.model, []).append(w)
        rows = []
        for model, waiters in sorted(by_model.items()):
            lanes = Counter(w.lane for w in waiters)
            rows.append({
                "name": model, "state": "waiting", "memory_bytes": waiters[0].needed, "pinned": 0,
                # Nothing loaded yet: it holds nothing, and its load may take what its plan says.
                "memory_held_bytes": 0, "memory_max_bytes": waiters[0].needed,
                "running": 0, "waiting": {lane: lanes.get(lane, 0) for lane in LANES},
                "waiting_for_load": len(waiters), "waited_s": round(now - min(w.since for w in waiters), 2),
                "reason": waiters[0].reason,
            })
        return rows
