"""A step as data: what the scheduler plans (StepPlan), what running it came to (StepResult), and
what the step produced for the engine to deliver (StepOutput).

The scheduler writes a StepPlan and reads a StepResult; engine/step.py is the one place that turns
the first into the second by calling the backend (as vLLM v1's SchedulerOutput and
ModelRunnerOutput); `Scheduler.postprocess` returns the StepOutput, which the engine delivers (as
vLLM v1's update_from_output returns EngineCoreOutputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..backends.base import BatchToken, SampledToken
from ..errors import LocalserveError
from ..protocol.requests import LoraSet
from .kv_ops import KVOp

if TYPE_CHECKING:
    from .sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    # Applied in order before the batch is decoded, whatever the decode's outcome: the books
    # already count them (kv_ops.py).
    kv_ops: list[KVOp] = field(default_factory=list)
    batch: list[BatchToken] = field(default_factory=list)
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens fed)
    outputs: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, batch row to sample)
    decode_tokens: int = 0
    prompt_tokens: int = 0
    draft_tokens: int = 0  # rows verifying drafts (speculation.py), beside the decodes they ride on
    # The backend may stop this step for an arrival that goes first (Backend.interrupt): a step of
    # batch-lane work alone, for any better lane's arrival; a step of prompt rows alone, for an
    # arrival whose prompt order (lanes.arrival_key) is before `yields_to`, the order of the step's
    # first prompt. A rolled-back prompt chunk costs its prompt the part of a step it had done; the
    # arrival then waits for none of it (issue 48: a 600-token prompt 1 s behind a 7,500-token one
    # waited out a 256-row chunk of it, its TTFT 1.5x its TTFT alone).
    interruptible: bool = False
    yields_to: tuple[int, int] | None = None
    # The LoRA adapters every fed sequence runs with (adapter_turns.py): the backend runs the
    # decode with them.
    adapters: LoraSet = ()


@dataclass(slots=True)
class StepResult:
    """What running a StepPlan came to (engine/step.py): `samples` pairs with plan.outputs (None:
    not sampled, the request was cancelled; an error: that request's sampler failed)."""

    outcome: Literal["done", "kv_full", "interrupted", "failed"]
    # A drafting sequence's entry is a list: its accepted drafts' samples and one more.
    samples: list[SampledToken | list[SampledToken] | LocalserveError | None] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(slots=True)
class StepOutput:
    """What the scheduler produced since its last output: the sequences with an event to hand to
    their streams (in order), and the KV operations that give finished or failed sequences' cells
    back, which the engine applies before the next plan so the cache agrees with the books."""

    updated: list[Sequence] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
