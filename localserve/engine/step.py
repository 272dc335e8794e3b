"""One step's model work, as data: apply the plan's KV operations, decode its batch, then sample
each row it asked for.

The scheduler plans a step and reads its outcome; it never calls the model (as nano-vllm's
scheduler never does, and vLLM v1's reads a ModelRunnerOutput). This is the one place a step calls
the backend. The KV operations go first and stay done whatever the decode does: the scheduler's
books counted them when it planned (batching/kv_ops.py). What can go wrong in the decode is an
outcome, not an exception the scheduler has to catch: the KV cache was full, a better lane's request
interrupted a batch-lane step, the decode failed, or one request's sampler did (a grammar dead end
fails only that request, with its own error).
"""

from __future__ import annotations

import logging
import time

from ..backends.base import Backend, DecodeInterrupted, KVFullError, SampledToken
from ..batching.kv_ops import KVCopy, KVMove, KVOp, KVRemove, KVRestore, KVSave
from ..batching.step_plan import StepPlan, StepResult
from ..errors import BackendError, GenerationError, LocalserveError

log = logging.getLogger(__name__)


def apply_kv_ops(backend: Backend, ops: list[KVOp]) -> None:
    """Make the backend's cache what the scheduler's books say, in the order they were written.
    A failure here is not a step outcome: the books are no longer the cache's, so it propagates
    and the engine fails the running requests (Scheduler.fail_running)."""
    for op in ops:
        if isinstance(op, KVRemove):
            backend.kv_remove(op.seq_id, op.p0, op.p1)
        elif isinstance(op, KVCopy):
            backend.kv_copy(op.src, op.dst, op.p0, op.p1)
        elif isinstance(op, KVMove):
            backend.kv_move(op.src, op.dst)
        elif isinstance(op, KVSave):  # best effort: a failed save costs a cache file, never a request
            op.disk.save(op.seq_id, op.tokens)
        elif isinstance(op, KVRestore):
            op.disk.restore(op.seq_id, op.state, op.keep)
        else:
            raise TypeError(f"not a KV operation: {op!r}")


def run(backend: Backend, plan: StepPlan) -> StepResult:
    apply_kv_ops(backend, plan.kv_ops)
    if not plan.batch:  # nothing to compute (a step that only released or moved KV)
        return StepResult("done")
    started = time.perf_counter()
    try:
        backend.set_adapters(plan.adapters)  # a no-op where the set is the last step's
        backend.decode(plan.batch, interruptible=plan.interruptible)
    except KVFullError:
        return StepResult("kv_full")
    except DecodeInterrupted:
        return StepResult("interrupted", seconds=time.perf_counter() - started)
    except Exception as e:  # noqa: BLE001 - one batch's failure fails its requests, not the engine
        if isinstance(e, BackendError):  # expected failure mode: the message says enough
            log.error("decode failed for %d requests: %s", len(plan.scheduled), e)
        else:
            log.exception("decode failed for %d requests", len(plan.scheduled))
        return StepResult("failed")
    seconds = time.perf_counter() - started
    samples: list[SampledToken | list[SampledToken] | LocalserveError | None] = []
    for seq, row in plan.outputs:
        if seq.cancelled:
            samples.append(None)
            continue
        try:
            samples.append(_verify(seq, row) if seq.draft else seq.sampler.sample(row))
        except LocalserveError as e:  # one request's constraints left no token: it alone fails
            samples.append(e)
        except Exception:  # noqa: BLE001
            log.exception("sampling failed for %s", seq.request_id)
            samples.append(GenerationError("sampling failed"))
    return StepResult("done", samples, seconds)


def _verify(seq, row: int) -> list[SampledToken]:
    """Sample a drafting sequence's rows in order with its own sampler, while each sample equals
    the draft token fed after it (batching/speculation.py): the accepted drafts, then the sample
    that differed or, when all matched, one more. An end-of-generation sample ends it too: nothing
    after it is ever emitted, and a grammar must not be fed past it."""
    samples = []
    for i, drafted in enumerate(seq.draft):
        sample = seq.sampler.sample(row + i)
        samples.append(sample)
        if sample.token != drafted or seq.is_eog(sample.token):
            return samples
    samples.append(seq.sampler.sample(row + len(seq.draft)))
    return samples
