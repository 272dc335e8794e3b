"""Which LoRA adapter set a step runs (issue 45, item 5).

llama.cpp applies adapters to a whole context (backends/llamacpp/lora.py), so one decode computes
every row with one set, and requests with different sets cannot share a step. The rule, *adapter
turns*: a step feeds only the sequences whose set is the step's, and the step's set is the one with
the best turn key among the sets that running or waiting sequences want:

- its best lane (interactive before default before batch),
- aged by one lane for every TURN_STEPS steps it has waited: since it last ran, or since its oldest
  request arrived if that is later (lanes.py ages requests the same way, by aging_steps),
- then the set that ran last step (a switch rebuilds llama.cpp's graph), then the longest waiting.

So a better lane's set runs at the next step; a set of the running one's lane runs within TURN_STEPS
steps, after which the first set waits in its turn: sets of one lane alternate every TURN_STEPS
steps, and a worse lane's set gains a lane every TURN_STEPS steps, so no set waits forever.
Sequences of another set keep their KV cells and their place among the running while they wait.
With one set wanted (every request of a model without adapters: the empty set) nothing changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ..protocol.requests import LoraSet

if TYPE_CHECKING:
    from .sequence import Sequence

# Steps a set runs while another set of its lane waits (~1 s of decode steps for a small model on a
# desktop CPU). Chosen, not measured: longer turns switch less often, shorter ones keep a waiting
# set's first token sooner.
TURN_STEPS = 32


class AdapterTurns:
    def __init__(self, turn_steps: int = TURN_STEPS) -> None:
        self.turn_steps = max(1, turn_steps)
        self.current: LoraSet = ()  # the set the last step ran
        self._last_ran: dict[LoraSet, int] = {}

    def pick(self, wanting: Iterable["Sequence"], step: int) -> LoraSet:
        """The step's set, among those the `wanting` sequences (running and waiting) have."""
        sets: dict[LoraSet, tuple[int, int]] = {}  # set -> (best lane rank, oldest arrival step)
        for seq in wanting:
            rank, arrived = sets.get(seq.adapters, (seq.lane_rank, seq.arrival_step))
            sets[seq.adapters] = (min(rank, seq.lane_rank), min(arrived, seq.arrival_step))
        if len(sets) > 1:
            def turn_key(adapters: LoraSet) -> tuple[int, bool, int]:
                rank, arrived = sets[adapters]
                since = max(arrived, self._last_ran.get(adapters, arrived))
                return rank - (step - since) // self.turn_steps, adapters != self.current, since

            self.current = min(sets, key=turn_key)
        elif sets:
            self.current = next(iter(sets))
        self._last_ran = {s: t for s, t in self._last_ran.items() if s in sets}
        self._last_ran[self.current] = step
        return self.current
