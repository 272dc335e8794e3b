"""Read-only views of a running Engine for the dashboard: each sequence's progress, the steps it
ran lately, and how its KV cells split between running sequences and the parked prefix cache.

Read from the event loop while the engine thread works: every read is a copy of a dict or deque
(atomic under the GIL) or an int, so it can be a step stale, never torn, and costs the engine
thread nothing (`Engine.in_flight`, `Engine.recent_steps`). An engine that batches by itself
(onnxruntime-genai's, an upstream) has neither: it shows no sequence rows and no steps. An engine
in a worker process (worker/) answers these from there, computed by this same module.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from ..batching.sequence import Sequence, Status
from ..protocol.engine import ModelEngine
from .local import Engine
from .worker.proxy import WorkerEngine


@dataclass
class SequenceProgress:
    state: str  # waiting | prefilling | decoding | parked
    prompt_tokens: int
    prompt_done: int  # prompt tokens in the KV cache (computed or from the prefix cache)
    generated: int
    cached: int  # prompt tokens the prefix cache served
    age_s: float
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def progress_of(seq: Sequence, now: float) -> SequenceProgress | None:
    """None once it finished (its row is about to go)."""
    status = seq.status
    if status is Status.FINISHED:
        return None
    if status is Status.WAITING:
        # Preempted back into its lane: its KV was parked as prefix cache (or dropped) until it runs again.
        state = "parked" if seq.num_preemptions else "waiting"
    else:
        state = "prefilling" if seq.pending > 1 else "decoding"
    return SequenceProgress(state, seq.num_prompt, min(seq.num_computed, seq.num_prompt), seq.num_generated,
                            seq.cached_tokens, round(now - seq.t_submit, 2), seq.num_preemptions)


def sequences(engine: ModelEngine) -> dict[str, SequenceProgress]:
    """request id -> progress, for every request the engine holds (queued ones included)."""
    if isinstance(engine, WorkerEngine):
        return engine.live("sequences") or {}
    if not isinstance(engine, Engine):
        return {}
    now = time.monotonic()
    out = {}
    for request_id, seq in engine.in_flight().items():
        progress = progress_of(seq, now)
        if progress is not None:
            out[request_id] = progress
    return out


def steps_since(engine: ModelEngine, since: float) -> list[tuple[float, float, int, int]]:
    """(end, seconds, decode rows, prompt rows) of each step that ended after `since` (monotonic),
    at most the last ten seconds' (the engine's rate window)."""
    if isinstance(engine, WorkerEngine):
        return engine.live("steps", since) or []
    if not isinstance(engine, Engine):
        return []
    return engine.recent_steps(since)


def parked_cells(engine: ModelEngine) -> int:
    """KV cells the prefix cache holds for finished requests (inside EngineStats.kv_used)."""
    if isinstance(engine, WorkerEngine):
        return engine.live("parked") or 0
    if not isinstance(engine, Engine):
        return 0
    entries = list(engine.scheduler.cache.parked.values())  # one C-level copy: the engine thread may re-key it
    return sum(len(entry.cells) for entry in entries)
