"""Read-only views of a running Engine for the dashboard: each sequence's progress, the steps it
ran lately, and how its KV cells split between running sequences and the parked prefix cache.

Read from the event loop while the engine thread works: every read is a copy of a dict or deque
(atomic under the GIL) or an int, so it can be a step stale, never torn, and costs the engine
thread nothing. The views are engine members (`live_sequences`, `live_steps`, `live_parked`):
our engine computes them with this module's helpers, and an engine in a worker process (worker/)
forwards them to its worker, which asks its own engine. An engine that batches by itself
(onnxruntime-genai's, an upstream) has none: it shows no sequence rows and no steps.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..batching.prefix_cache import CachedPrefix
from ..batching.sequence import Sequence, Status
from ..protocol.engine import ModelEngine


@dataclass
class SequenceProgress:
    state: str  # waiting | prefilling | decoding | parked
    prompt_tokens: int
    prompt_done: int  # prompt tokens in the KV cache (computed or from the prefix cache)
    generated: int
    cached: int  # prompt tokens the prefix cache served
    age_s: float
    preemptions: int
    # Waiting: seconds its lane has gone without a step (what queue_timeout counts); 0 otherwise.
    stalled_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def progress_of(seq: Sequence, now: float, stalled: Callable[[Sequence, float], float]) -> SequenceProgress | None:
    """None once it finished (its row is about to go). `stalled`: Scheduler.stalled_s."""
    status = seq.status
    if status is Status.FINISHED:
        return None
    if status is Status.WAITING:
        # Preempted back into its lane: its KV was parked as prefix cache (or dropped) until it runs again.
        state = "parked" if seq.num_preemptions else "waiting"
    else:
        state = "prefilling" if seq.pending > 1 else "decoding"
    return SequenceProgress(state, seq.num_prompt, min(seq.num_computed, seq.num_prompt), seq.num_generated,
                            seq.cached_tokens, round(now - seq.t_submit, 2), seq.num_preemptions,
                            round(stalled(seq, now), 2) if status is Status.WAITING else 0.0)


def progress_rows(in_flight: dict[str, Sequence],
                  stalled: Callable[[Sequence, float], float]) -> dict[str, SequenceProgress]:
    """request id -> progress of an engine's requests (queued ones included; finished ones not)."""
    now = time.monotonic()
    rows = ((request_id, progress_of(seq, now, stalled)) for request_id, seq in in_flight.items())
    return {request_id: progress for request_id, progress in rows if progress is not None}


def cells_of(parked: list[CachedPrefix]) -> int:
    return sum(len(entry.cells) for entry in parked)


def sequences(engine: ModelEngine) -> dict[str, SequenceProgress]:
    """request id -> progress, for every request the engine holds (queued ones included)."""
    view = getattr(engine, "live_sequences", None)
    return (view() or {}) if view is not None else {}


def steps_since(engine: ModelEngine, since: float) -> list[tuple[float, float, int, int]]:
    """(end, seconds, decode rows, prompt rows) of each step that ended after `since` (monotonic),
    at most the last ten seconds' (the engine's rate window)."""
    view = getattr(engine, "live_steps", None)
    return (view(since) or []) if view is not None else []


def parked_cells(engine: ModelEngine) -> int:
    """KV cells the prefix cache holds for finished requests (inside EngineStats.kv_used)."""
    view = getattr(engine, "live_parked", None)
    return (view() or 0) if view is not None else 0
