"""The scheduler's side of speculative decoding (speculation.py has the drafts and the policy):
which of a step's decoders draft, their rows in the plan, and what the verification confirmed.

A drafting sequence's books move in two places: `add_drafts` counts cells for its k drafts when
the step is planned; `take_verified` keeps only the pending row and the accepted drafts that were
emitted, and records a removal of the rest (KVPool.truncate), applied before the next step."""

from __future__ import annotations

import itertools

from ..backends.base import BatchToken, SampledToken
from ..protocol.requests import FinishReason
from .kvpool import KVPool
from .sequence import Sequence
from .speculation import K_MAX, Candidate, DraftPolicy, DraftState, step_calls
from .step_plan import StepPlan


def add_drafts(policy: DraftPolicy, pool: KVPool, feeds: list[tuple[Sequence, int]], budget: int,
               separate_calls: bool) -> list[tuple[Sequence, int]]:
    """Drafts for this step's decoders, in a step without prompt chunks (never delay one), in
    the budget and free cells left (never evict or preempt for them)."""
    if budget <= 0 or any(n > 1 or not s.num_generated for s, n in feeds):
        return feeds
    candidates = []
    for seq, _ in feeds:
        room = min(K_MAX, seq.request.max_tokens - seq.num_generated - 1, seq.n_ctx_seq - len(seq.tokens) - 1)
        if seq.think is not None and seq.think.spec.budget is not None and seq.think.state == "think":
            room = min(room, seq.think.spec.budget - seq.think.tokens)  # drafts past it are thrown away
        if room < 1 or not seq.request.speculative:
            continue
        seq.spec = seq.spec or DraftState()
        draft, match = seq.spec.lookup.draft(seq.tokens, room)
        # An image's positions (negative ids, protocol/media_ids.py) are never drafted: no sample
        # equals one, and its row would be an image embedding decoded as a guess.
        draft = list(itertools.takewhile(lambda t: t >= 0, draft))
        if draft:
            candidates.append(Candidate(seq, seq.spec, draft, match))
    if not candidates:
        return feeds
    drafts = {id(c.key): c.draft for c in candidates}
    calls = step_calls([1] * len(feeds), separate_calls)
    grown = {}
    for seq, k in policy.choose(candidates, len(feeds), calls, len(feeds)):
        k = min(k, budget, pool.free)
        if k > 0:
            pool.grow(seq, k)
            seq.draft = drafts[id(seq)][:k]
            grown[id(seq)] = k
            budget -= k
    return [(seq, n + grown.get(id(seq), 0)) for seq, n in feeds]


def feed_draft(plan: StepPlan, seq: Sequence) -> None:
    """A decoder's pending token and its drafts as consecutive rows, every one sampled."""
    start, sid = seq.num_computed, seq.seq_id
    plan.outputs.append((seq, len(plan.batch)))
    rows = [seq.tokens[start], *seq.draft]
    plan.batch.extend(BatchToken(t, sid, start + i, True) for i, t in enumerate(rows))
    plan.scheduled.append((seq, len(rows)))
    plan.decode_tokens += 1
    plan.draft_tokens += len(seq.draft)


def take_verified(policy: DraftPolicy, pool: KVPool, seq: Sequence, samples: list[SampledToken]) -> FinishReason | None:
    """A drafting sequence's samples appended up to a finish, its acceptance recorded and its KV
    kept up to what they confirmed; returns why the sequence finishes, if it does."""
    reason, emitted = None, 0
    for token in samples:
        # A spent thinking budget puts the end-of-think tokens where this sample was: the drafts
        # verified after it were checked against a token the sequence no longer has.
        forced = seq.closing_thought
        emitted += not forced
        reason = seq.append(token)
        if reason or forced:
            break
    policy.record(seq.request.lane, seq.spec, len(seq.draft), len(samples) - 1)
    keep_verified(pool, seq, len(samples) - 1, emitted)
    return reason


def keep_verified(pool: KVPool, seq: Sequence, accepted: int, emitted: int) -> None:
    """A drafting sequence's KV kept up to the pending row and the `accepted` drafts that were
    emitted; the rejected rows' cells are removed before the next step."""
    keep = seq.num_computed - len(seq.draft) + min(accepted, emitted)
    seq.num_computed = keep
    pool.truncate(seq, keep)
    seq.draft = []
