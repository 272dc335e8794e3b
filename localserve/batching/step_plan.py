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
    # Only batch-lane work: the backend may stop it for a better lane's arrival (Backend.interrupt).
    interruptible: bool = False
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
