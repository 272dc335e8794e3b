"""KV-cache operations as data: what the planner wants done to the backend's cache.

The scheduler decides which sequence ids hold which positions (kvpool.py keeps the books) but never
touches the cache itself: every change it makes to the books is written down here, in order, and
travels with the next StepPlan. engine/step.py applies a plan's operations before its decode, the
only place the backend is called during a step (as vLLM v1's SchedulerOutput carries the block
copies and frees its workers apply). Applying them in order is all that keeps the two agreeing:
an id released and handed out again in the same plan is removed before it is copied into.

Operations recorded after a plan was made (a request that finished in postprocess, a failed batch
dropped) come back in the StepOutput postprocess returns, and the engine applies them at the end of
the same step (Engine._deliver, through the same engine/step.py function), before the request's
last event is sent: an idle engine's cache holds what its books say. Whatever is left over (a
release that failed) goes with the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Union


@dataclass(frozen=True, slots=True)
class KVCopy:
    """Make positions [p0, p1) of sequence `src` part of `dst` too (a prefix-cache hit): shared cells
    in a unified pool, a copy into dst's own stream otherwise (Capabilities.prefix_sharing)."""

    src: int
    dst: int
    p0: int
    p1: int


@dataclass(frozen=True, slots=True)
class KVRemove:
    """Drop positions [p0, p1) of `seq_id` (p1 = -1: to the end): a release, or an adopted entry's
    tail past the shared prefix."""

    seq_id: int
    p0: int = 0
    p1: int = -1


@dataclass(frozen=True, slots=True)
class KVMove:
    """Move everything `src` holds to the empty id `dst` (keeping running ids consecutive, or a
    parked entry out of their way); `src` is left empty."""

    src: int
    dst: int


class DiskEntryLike(Protocol):
    tokens: list[int]


class DiskTier(Protocol):
    """The prompt cache on disk, as the prefix cache uses it (engine/prompt_disk.py)."""

    min_tokens: int  # shorter entries are not written: recomputing them costs less than a file
    trim_margin: int | None  # how far before its end a restored state may be cut (None: anywhere)

    def entries(self) -> list[DiskEntryLike]: ...

    def read(self, entry: DiskEntryLike) -> bytes | None: ...

    def save(self, seq_id: int, tokens: Sequence[int]) -> None: ...

    def restore(self, seq_id: int, state: bytes, keep: int) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class KVSave:
    """Write what `seq_id` holds (the KV of `tokens`) to the prompt cache on disk, before a
    release drops it or while the engine idles (prefix_cache.py)."""

    seq_id: int
    tokens: tuple[int, ...]
    disk: "DiskTier"


@dataclass(frozen=True, slots=True, eq=False)
class KVRestore:
    """Put a state read from the prompt cache on disk into the empty `seq_id`, keeping its first
    `keep` positions (a prefix hit on a file)."""

    seq_id: int
    keep: int
    state: bytes
    disk: "DiskTier"


KVOp = Union[KVCopy, KVRemove, KVMove, KVSave, KVRestore]
