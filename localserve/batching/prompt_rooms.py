"""How many prompt tokens of one waiting or prefilling sequence a step may take (schedule()'s
step 6), given what the step already holds. The rules, each with its reason:

- **Top lane alone.** While a request of the top lane (or one aged into it) is prefilling, lower
  lanes' prompts stay out of the step: a step's length is its token count, and the top lane's
  first token should not wait for a batch job's prompt chunk.
- **Worse lanes' share.** While better lanes decode, worse lanes' prompt chunks together get a
  small share of the step (a quarter of the budget, at least one chunk): a 240-token chunk of a
  batch job would hold every interactive stream's next token back by its whole prefill (0.6 s on a
  2-core CPU).
- **Background time.** Batch-lane chunks together add at most the step-time target to the step,
  so an interactive request arriving meanwhile waits for little more than its own prefill.
- **Alone.** A backend that can interrupt a step lets batch work running alone take longer steps:
  big chunks cost less per token, and an arrival stops the step instead of waiting for its end.
  The time room then only decides whether a prompt starts in this step: it goes whole if it fits,
  and one that fits only in part waits for a step where it comes first. A cut costs a micro-batch
  and smaller matmuls (on 2 cores a prompt cut in two costs a sixth more).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Capabilities
from .sequence import Sequence


@dataclass
class PromptRooms:
    caps: Capabilities
    top_rank: int  # the best effective lane among the prefillers (0: interactive or aged into it)
    best_decoding: int | None  # the best lane rank fed a decode this step, if any
    worse_share: int  # prompt tokens left for lanes worse than best_decoding
    background_room: int  # batch-lane prompt tokens left within the step-time target
    alone: bool  # only batch work runs, on a backend that can interrupt a step
    background_fed: bool = False

    def room(self, seq: Sequence, rank: int, budget: int) -> int | None:
        """Prompt tokens `seq` (of lane rank `rank`) may take out of `budget`; None: it sits
        this step out."""
        if self.top_rank <= 0 and rank > 0:
            return None
        room = min(budget, self.worse_share) if self._worse(rank) else budget
        if seq.request.lane != "batch":
            return room
        room = min(room, self.background_room)
        if self.alone and room >= self.caps.min_chunk:
            if seq.pending <= budget:
                return budget
            if self.background_fed:
                return None
        return room

    def took(self, seq: Sequence, rank: int, n: int) -> None:
        if self._worse(rank):
            self.worse_share -= n
        if seq.request.lane == "batch":
            self.background_room -= n
            self.background_fed = True

    def _worse(self, rank: int) -> bool:
        return self.best_decoding is not None and rank > self.best_decoding
