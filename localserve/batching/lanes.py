"""Priority lanes with aging: interactive > default > batch, and nobody waits forever.

A request's effective rank is its lane's rank minus one for every `aging_steps` steps since it
arrived. The same rank orders the waiting queues *and* picks preemption victims: without that, a
batch request that finally aged into the running set would be preempted again by the next fresh
interactive one, and a steady interactive stream would still starve it.

Within a rank, prompts are read earliest *due step* first (`prompt_key`): a prompt is due
`STRETCH` times the steps it needs alone (its uncached tokens over the step budget) after it
arrived. Among prompts that are not late that is least work first, so a 600-token title request
that arrives behind a 7,500-token agent turn is read in its own few steps instead of after the
turn's thirty (issue 48: opencode's title waited 211 s behind its own turn). A due step never
moves, so a long prompt under a stream of short ones is passed only until it is due; from then on
every newcomer, due later, waits behind it (aging: no prompt is read later than about STRETCH
times its time alone, plus what was late before it).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

from ..protocol.requests import LANES, LoraSet

if TYPE_CHECKING:
    from .sequence import Sequence


# A prompt may be passed by shorter ones until it has waited this many times its own steps alone.
# Larger favours short prompts longer; 1 reads a prompt that has waited its own length before any
# newcomer. 4 is chosen, not yet measured against other values (issue 48 asks for that).
STRETCH = 4


def priority_key(seq: "Sequence", step: int, aging_steps: int) -> tuple[int, int]:
    """Smaller is better: (effective rank, arrival order)."""
    return seq.lane_rank - (step - seq.arrival_step) // aging_steps, seq.order


def due_step(arrival_step: int, work_tokens: int, budget: int, stretch: int = STRETCH) -> int:
    """The step a prompt of `work_tokens` uncached tokens arriving at `arrival_step` is due."""
    return arrival_step + stretch * -(-max(1, work_tokens) // budget)


def prompt_key(seq: "Sequence", step: int, aging_steps: int) -> tuple[int, int, int]:
    """Which prompt is read first, smaller first: (effective rank, due step, arrival order)."""
    rank, order = priority_key(seq, step, aging_steps)
    return rank, seq.due_step, order


def arrival_key(lane_rank: int, prompt_tokens: int, step: int, budget: int) -> tuple[int, int]:
    """prompt_key's (rank, due step) for a request arriving at `step`, its whole prompt counted as
    work (the prefix cache may hold some: then it is due earlier than this says)."""
    return lane_rank, due_step(step, prompt_tokens, budget)


class LaneQueues:
    """Waiting sequences by lane, in arrival order (preempted ones back at the front of theirs);
    `peek` picks by the key it is given."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Sequence]] = {lane: deque() for lane in LANES}

    def push(self, seq: "Sequence") -> None:
        self._queues[seq.request.lane].append(seq)

    def push_front(self, seq: "Sequence") -> None:
        self._queues[seq.request.lane].appendleft(seq)

    def peek(self, key: Callable[["Sequence"], tuple[int, ...]],
             adapters: LoraSet | None = None) -> "Sequence | None":
        """The best waiting sequence by `key` (the scheduler's prompt_key: a short prompt that
        arrived last in its lane may start before the long ones ahead of it); of those with the
        LoRA set `adapters` only, where given (adapter_turns.py)."""
        return min((s for s in self if adapters is None or s.adapters == adapters), key=key, default=None)

    def remove(self, seq: "Sequence") -> None:
        queue = self._queues[seq.request.lane]
        if queue and queue[0] is seq:
            queue.popleft()
        else:
            queue.remove(seq)

    def counts(self) -> dict[str, int]:
        return {lane: len(q) for lane, q in self._queues.items()}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator["Sequence"]:
        for queue in self._queues.values():
            yield from list(queue)
