"""Priority lanes with aging: interactive > default > batch, and nobody waits forever.

A request's effective rank is its lane's rank minus one for every `aging_steps` steps since it
arrived. The same rank orders the waiting queues *and* picks preemption victims: without that, a
batch request that finally aged into the running set would be preempted again by the next fresh
interactive one, and a steady interactive stream would still starve it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator

from ..protocol.requests import LANES

if TYPE_CHECKING:
    from .sequence import Sequence


def priority_key(seq: "Sequence", step: int, aging_steps: int) -> tuple[int, int]:
    """Smaller is better: (effective rank, arrival order)."""
    return seq.lane_rank - (step - seq.arrival_step) // aging_steps, seq.order


class LaneQueues:
    """Waiting sequences, FIFO within a lane; preempted ones go back to the front of theirs."""

    def __init__(self, aging_steps: int):
        self.aging_steps = aging_steps
        self._queues: dict[str, deque[Sequence]] = {lane: deque() for lane in LANES}

    def push(self, seq: "Sequence") -> None:
        self._queues[seq.request.lane].append(seq)

    def push_front(self, seq: "Sequence") -> None:
        self._queues[seq.request.lane].appendleft(seq)

    def peek(self, step: int) -> "Sequence | None":
        """The best waiting sequence: only lane heads compete (FIFO inside a lane)."""
        heads = [q[0] for q in self._queues.values() if q]
        if not heads:
            return None
        return min(heads, key=lambda s: priority_key(s, step, self.aging_steps))

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
