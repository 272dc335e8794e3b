"""The continuous-batching scheduler: which tokens of which sequences go into the next step.

Each step has one token budget (<= the backend's max_batch_tokens, so one backend.decode per step).
Everything it knows about the backend comes from the backend's declared Capabilities
(backends/base.py), and it never calls the backend: a StepPlan carries the batch and the KV-cache
operations that go before it (kv_ops.py), engine/step.py runs it, and postprocess() reads the
StepResult that comes back (failures included) and keeps the books. Running
sequences with one pending token (decoding) go first, best lane first; then prompt chunks of
admitted sequences fill the rest, so a 4k-token prompt is spread over several steps instead of
freezing every stream for one long step. Waiting requests are admitted by KV capacity; when the
cache is full the worst sequence (lowest effective lane, most recent) is preempted -- its KV is
parked as prefix cache and dropped only if memory is really needed, and it is re-fed later --
instead of failing anyone. Shape after nano-vllm and vLLM v1: schedule() -> step.run -> postprocess().
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..backends.base import BatchToken, Capabilities
from ..errors import GenerationError, LocalserveError, OverloadedError
from .adapter_turns import AdapterTurns
from .admission import Admission
from .drafting import add_drafts, feed_draft, keep_verified, take_verified
from .encode_charge import before_encode, encode_charge
from .kvpool import KVPool
from .lanes import LaneQueues, arrival_key, due_step, priority_key, prompt_key
from .limits import EngineLimits
from .prefix_cache import PrefixCache, common_prefix
from .prompt_rooms import PromptRooms
from .step_clock import StepClock
from .sequence import Sequence, Status
from .speculation import DraftPolicy, step_calls
from .step_plan import StepOutput, StepPlan, StepResult

log = logging.getLogger(__name__)

# Prompt tokens of lanes worse than a decoding one: at most this fraction of the step budget.
_WORSE_LANE_SHARE = 4


@dataclass
class _Feeds:
    """What one step feeds so far: (sequence, tokens) in order, the budget left, and the running
    sequences not fed yet (what a reservation may preempt)."""

    budget: int
    unscheduled: set[int]
    feeds: list[tuple[Sequence, int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.feeds.append((seq, n))
        self.unscheduled.discard(id(seq))
        self.budget -= n


class Scheduler(Admission):
    def __init__(
        self,
        caps: Capabilities,
        limits: EngineLimits,
        on_dequeue: Callable[[Sequence], None] | None = None,
    ):
        if not isinstance(caps, Capabilities):
            raise TypeError(f"the scheduler plans by a Capabilities, not {type(caps).__name__}")
        self.caps = caps
        self.budget = min(limits.batch_tokens, caps.max_batch_tokens)
        self.max_running = max(1, min(limits.max_sequences, caps.max_seqs, self.budget))
        self.worse_lane_share = _WORSE_LANE_SHARE  # benchmarks/engine.py compares it with 1 (no cap)
        # Batch-lane prompt chunks are cut to a time target from measured step costs (step_clock.py).
        self.clock = StepClock(limits.batch_step_s)
        self.pool = KVPool(caps, min(limits.n_ctx, caps.kv_cells), caps.max_seqs, self.max_running)
        self.n_ctx_seq = min(limits.n_ctx_seq, self.pool.n_cells_seq)
        self.cache = PrefixCache(self.pool, limits.prefix_cache, caps.min_recompute, limits.prefix_release_s)
        speculate = caps.speculation and limits.speculative != "off"
        self.drafts = DraftPolicy(limits.speculative, caps.consecutive_ids) if speculate else None
        self.lanes = LaneQueues()
        self.turns = AdapterTurns()
        self.aging_steps = limits.aging_steps
        self.queue_timeout = limits.queue_timeout
        self.running: list[Sequence] = []
        self.step = 0
        self.preemptions = 0
        self.interrupted_steps = 0
        self._updated: list[Sequence] = []  # sequences with an event for the next StepOutput
        self._next_timeout_check = 0.0
        # lane -> when a step last fed one of its sequences (monotonic): the queue timeout counts
        # from there, so a request waiting while the ones ahead of it are read is never "stuck".
        self.lane_progress: dict[str, float] = {}
        # Set when a decode found the backend fuller than our books and a sequence was preempted
        # for it: no admissions while others run, until one of them finishes. Without it the victim
        # came straight back (the books still said it fits), the next decode overflowed again, and
        # the engine spun forever on steps that never progress.
        self._hold_admissions = False
        # Called once per sequence when it leaves its lane's queue for good (started or finished
        # while waiting): the engine bounds its queues with that count.
        self._on_dequeue = on_dequeue or (lambda seq: None)

    # --- entry points (engine thread only) -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step
        seq.due_step = self._due(seq)
        self.lanes.push(seq)

    def _due(self, seq: Sequence) -> int:
        """seq's due step (lanes.py). Its work is what the prefix cache holds no copy of now (an
        agent's next turn needs only its tail); the hit itself is taken when it starts, and may
        have grown or gone by then. A prompt whose prefix is still being read by another (eight
        requests with one system prompt, arriving together) is not due before that one: read
        first, it would compute the part the other is about to share with it. Load C's first wave
        computed 1,790 prompt tokens that way against 1,258 (2026-12-07)."""
        holder, hit = self.cache.lookup(seq.tokens, self.running, seq.adapters)
        if isinstance(holder, Sequence) and holder.pending > 1:
            shared = common_prefix(seq.tokens, holder.tokens, len(seq.tokens) - self.cache.min_recompute)
            if shared > hit:
                return max(due_step(self.step, len(seq.tokens) - shared, self.budget), holder.due_step)
        return due_step(self.step, len(seq.tokens) - hit, self.budget)

    def goes_before(self, seq: Sequence, yields_to: tuple[int, int] | None) -> bool:
        """Whether `seq`, arriving now, goes before a step planned to yield to `yields_to`
        (step_plan.py): any better lane before a step of batch work alone (None), and before a step
        of prompt rows alone a prompt read first. Read from the submitting thread: `step` and
        `budget` are ints it may read while the engine thread plans."""
        if seq.request.lane == "batch":
            return False
        if yields_to is None:
            return True
        return arrival_key(seq.lane_rank, len(seq.tokens), self.step, self.budget) < yields_to

    def has_work(self) -> bool:
        return bool(self.running) or len(self.lanes) > 0

    def key(self, seq: Sequence) -> tuple[int, int]:
        return priority_key(seq, self.step, self.aging_steps)

    def prompt_key(self, seq: Sequence) -> tuple[int, int, int]:
        """The order prompts are admitted and read in: lane first, then earliest due (lanes.py)."""
        return prompt_key(seq, self.step, self.aging_steps)

    def schedule(self) -> StepPlan:
        """The next step's plan, by the rules docs/architecture.md numbers."""
        self.step += 1
        self._reap()  # 1. cancelled and timed-out requests leave
        self._make_room()  # 2. preempt worse lanes for a better waiting request
        adapters = self.turns.pick([*self.running, *self.lanes], self.step)  # 3. one LoRA set a step
        order = sorted((s for s in self.running if s.adapters == adapters), key=self.key)
        fed = _Feeds(self.budget, set(map(id, order)))
        decoders = self._feed_decoders(order, fed)  # 4. every decoder's next token first
        # (Decoders' reservations may have preempted some of these: only running ones remain.)
        prefillers = [s for s in order if s.pending > 1 and s.status is Status.RUNNING]
        self._admit(prefillers, fed.budget)  # 5. waiting requests of the set whose prompts fit
        prefillers.sort(key=self.prompt_key)
        fed.unscheduled.update(map(id, prefillers))
        self._feed_prompts(prefillers, fed)  # 6. prompt chunks in the rest of the budget
        self._never_empty(prefillers, fed)
        feeds = fed.feeds
        if self.caps.consecutive_ids:
            feeds = self._consecutive_ids(feeds, decoders)  # 7. one block of ids, sit-outs
        if self.drafts is not None:
            feeds = add_drafts(self.drafts, self.pool, feeds, fed.budget, self.caps.consecutive_ids)
        plan = StepPlan(kv_ops=self.pool.take_ops(), adapters=adapters)
        for seq, n in feeds:
            if seq.status is Status.RUNNING:
                self._feed(plan, seq, n)
        plan.interruptible, plan.yields_to = self._interruptible(plan)
        return plan

    def _interruptible(self, plan: StepPlan) -> tuple[bool, tuple[int, int] | None]:
        """Whether an arrival may stop the step, and which (step_plan.py): batch work alone stops
        for any better lane; prompt rows alone, where no stream waits for a token, for a prompt
        that would be read before the step's first."""
        if not self.caps.interruptible or not plan.scheduled:
            return False, None
        if all(s.request.lane == "batch" for s, _ in plan.scheduled):
            return True, None
        if plan.decode_tokens or plan.draft_tokens:
            return False, None
        return True, min(self.prompt_key(s)[:2] for s, _ in plan.scheduled)

    def _feed_decoders(self, order: list[Sequence], fed: "_Feeds") -> list[Sequence]:
        decoders = [s for s in order if s.pending == 1]
        for seq in decoders:
            if fed.budget == 0:
                break
            if self._reserve(seq, 1, fed.unscheduled):
                fed.add(seq, 1)
        return decoders

    def _feed_prompts(self, prefillers: list[Sequence], fed: "_Feeds") -> None:
        min_chunk = self.caps.min_chunk
        alone = self.caps.interruptible and all(s.request.lane == "batch" for s in self.running)
        rooms = PromptRooms(
            self.caps,
            top_rank=self.key(prefillers[0])[0] if prefillers else 1,
            best_decoding=min((self.key(s)[0] for s, _ in fed.feeds), default=None),
            worse_share=max(min_chunk, self.budget // self.worse_lane_share),
            background_room=max(min_chunk, self.clock.prompt_tokens_within(self.budget, len(fed.feeds), alone)),
            alone=alone,
        )
        for seq in prefillers:
            if fed.budget < min_chunk:
                break
            rank = self.key(seq)[0]
            room = rooms.room(seq, rank, fed.budget)
            if room is None:
                continue
            want = self.caps.chunk(seq.pending, room)
            if not want and seq.request.lane == "batch":
                # The time target is soft by less than min_chunk: a 3-token prompt under a 2-token
                # room has no valid cut (2 + a lone 1), and with only such prompts running nothing
                # was fed at all and the engine spun on empty steps.
                want = self.caps.chunk(seq.pending, min(fed.budget, room + min_chunk - 1))
            if fed.feeds:  # an encode delays only what shares its step: alone an image goes at once
                want = before_encode(self.caps, seq.tokens, seq.num_computed, want, room)
            n = self._reserve(seq, want, fed.unscheduled, shrink=True)
            if n:
                fed.add(seq, n)
                charge = encode_charge(seq.tokens, seq.num_computed, n)[0]  # an image encoded in this step
                fed.budget = max(0, fed.budget - charge)
                rooms.took(seq, rank, n + charge)

    def _never_empty(self, prefillers: list[Sequence], fed: "_Feeds") -> None:
        """Never an empty step while prompts wait: the engine would spin on it for ever. The rules
        above should not allow it; this keeps a mistake in them from hanging the daemon."""
        if fed.feeds or not prefillers or prefillers[0].status is not Status.RUNNING:
            return
        seq = prefillers[0]
        log.warning("no tokens scheduled for %d running sequences; feeding %s", len(self.running), seq.request_id)
        n = self._reserve(seq, self.caps.chunk(seq.pending, fed.budget), fed.unscheduled, shrink=True)
        if n:
            fed.feeds.append((seq, n))

    def _consecutive_ids(self, feeds: list[tuple[Sequence, int]], decoders: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Both rules come from llama.cpp's splitter with a KV stream per sequence (split_equal):
        batch rows riding along a prompt chunk cost it micro-batches, and only consecutive ids are
        computed in one pass. A backend without that splitter runs neither."""
        feeds = self._sit_out(feeds, {id(seq) for seq in decoders})
        # Ids are final only now (finishes, preemptions and adoptions leave holes).
        block = self.pool.block([q.seq_id for q in self.running], list(self.cache.parked))
        self.cache.vacate(block)
        self.pool.gather(self.running, block)
        return feeds

    def postprocess(self, plan: StepPlan, result: StepResult) -> StepOutput:
        """Read a step's outcome (engine/step.py ran it): advance the fed sequences by their
        samples, or undo the step and make room, or fail its requests; return what the step
        produced (with what scheduling it did: a request that timed out in its queue)."""
        self._read(plan, result)
        return self.take_output()

    def take_output(self, kv_ops: bool = True) -> StepOutput:
        """Everything produced since the last output: events to deliver, KV to give back (unless
        `kv_ops` is false: they then go with the next plan). The engine takes it after each step,
        and after failing or finishing requests outside one."""
        output = StepOutput(self._updated, self.pool.take_ops() if kv_ops else [])
        self._updated = []
        return output

    def _read(self, plan: StepPlan, result: StepResult) -> None:
        if not plan.batch:  # a plan of KV operations alone, or nothing: no step to read
            return
        if result.outcome == "kv_full":
            log.debug("KV cache full at step %d; freeing cells", self.step)
            self.on_kv_full(plan)
            return
        if result.outcome == "interrupted":
            # A request that goes first arrived (step_plan.py): the next plan has it; this step is redone.
            log.debug("step %d interrupted after %.1f ms", self.step, result.seconds * 1000)
            self._rollback(plan)
            self.interrupted_steps += 1
            return
        if result.outcome == "failed":
            self.on_error(plan, "the model failed to process this request")
            return
        # Draft rows cost what prompt rows do: several rows of one sequence in a call.
        self.clock.observe(plan.decode_tokens, plan.prompt_tokens + plan.draft_tokens, result.seconds)
        if self.drafts is not None and not plan.prompt_tokens:  # prompt rows have no logits: cheaper
            calls = step_calls((n for _, n in plan.scheduled), self.caps.consecutive_ids)
            self.drafts.costs.observe(calls, len(plan.batch), result.seconds)
        log.debug("step %d: %d decode + %d prompt tokens in %.1f ms; %d running, %d waiting", self.step,
                  plan.decode_tokens, plan.prompt_tokens, result.seconds * 1000, len(self.running), len(self.lanes))
        now = time.monotonic()
        for seq, n in plan.scheduled:
            seq.num_computed += n
            self.lane_progress[seq.request.lane] = now
        for (seq, _), sample in zip(plan.outputs, result.samples):
            if seq.status is not Status.RUNNING:
                continue
            if seq.draft and not isinstance(sample, list):  # cancelled or failed: only the pending row stands
                keep_verified(self.pool, seq, 0, 0)
            if sample is None:  # not sampled: the request was cancelled
                self.finish(seq, "cancelled")
            elif isinstance(sample, LocalserveError):
                self.finish(seq, "error", sample)
            else:
                reason = (take_verified(self.drafts, self.pool, seq, sample) if isinstance(sample, list)
                          else seq.append(sample))
                if reason:
                    self.finish(seq, reason)
                else:
                    self._updated.append(seq)

    def on_kv_full(self, plan: StepPlan) -> None:
        """decode found no room (our accounting was optimistic: fragmentation, or a backend
        that reserves cells). Undo the step, free something, let the next step retry."""
        self._rollback(plan)
        if self.cache.evict_one():
            return
        if len(self.running) > 1:
            self._preempt(max(self.running, key=self.key), park=False)
            self._hold_admissions = True
        elif self.running:
            self.finish(self.running[0], "error", GenerationError("the model's context memory is exhausted"))

    def on_error(self, plan: StepPlan, message: str) -> None:
        """The backend failed this batch: only its requests fail. Their KV may be half-written,
        so it is dropped, never parked as cache."""
        self._rollback(plan)
        for seq, _ in plan.scheduled:
            if seq.status is Status.RUNNING:
                self.pool.release(seq)
                self.finish(seq, "error", GenerationError(message))

    def finish(self, seq: Sequence, reason, error: LocalserveError | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            # A cancelled request's answer is of no use to anyone: the next hit may take it over.
            self._park_or_release(seq, disposable=reason == "cancelled")
            self._hold_admissions = False  # its cells are free: what was held back may fit now
        else:
            self.lanes.remove(seq)
            self._dequeued(seq)
        seq.mark_finished(reason, error)
        self._updated.append(seq)

    def finish_all(self, reason="cancelled") -> None:
        for seq in [*self.running, *self.lanes]:
            self.finish(seq, reason)

    def fail_running(self, message: str) -> None:
        """After an unexpected error the running sequences' KV cannot be trusted: drop and fail them."""
        for seq in list(self.running):
            self.pool.release(seq)
            self.finish(seq, "error", GenerationError(message))

    # --- internals -------------------------------------------------------------------------
    def _sit_out(self, feeds: list[tuple[Sequence, int]], decoders: set[int]) -> list[tuple[Sequence, int]]:
        """Decoders that sit out a step carrying a prompt chunk (their cells are uncounted again),
        under llama.cpp's KV stream per sequence, where the backend computes each prompt chunk in
        a call of its own and the decodes in one more after it (llamacpp/batch.stream_groups):

        - batch-lane decoders, beside any chunk of a better lane: that step's length is the
          interactive request's first-token wait, and eight batch rows add a call to it (+65 ms
          on 2 cores, a fifth of a short chat's TTFT), while the batch only loses a step;
        - any decoder of the same or a worse lane, beside the *last* chunk of a prompt: riding
          along, it would get its token at the end of the step, after the chunk's call and its
          own; sitting out, it gets it one step later, which ends at the same time but for one
          step's overhead, and the prompt's first token comes a decode call sooner (an editor's
          keystroke beside 4 chats: its 3 tokens in 12 ms instead of 12 + 20). Beside a chunk
          that does not finish its prompt it rides along: it would wait a whole prompt instead."""
        prompts = [(s, n) for s, n in feeds if id(s) not in decoders]
        best = min((self.key(s)[0] for s, _ in prompts if s.request.lane != "batch"), default=None)
        best_last = min((self.key(s)[0] for s, n in prompts if n == s.pending), default=None)
        if best is None and best_last is None:
            return feeds
        kept = []
        for seq, n in feeds:
            rank = self.key(seq)[0]
            if id(seq) in decoders and ((seq.request.lane == "batch" and best is not None and rank > best)
                                        or (best_last is not None and rank >= best_last)):
                self.pool.uncount(seq, len(seq.cells) - n)
            else:
                kept.append((seq, n))
        return kept

    def _feed(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        if seq.draft:
            feed_draft(plan, seq)
            return
        start = seq.num_computed
        end = start + n
        tokens = seq.tokens
        sid = seq.seq_id
        batch = plan.batch
        batch.extend(BatchToken(tokens[p], sid, p) for p in range(start, end - 1))
        last = end == len(tokens)  # logits only where the sequence's next token is sampled
        batch.append(BatchToken(tokens[end - 1], sid, end - 1, last))
        if last:
            plan.outputs.append((seq, len(batch) - 1))
        plan.scheduled.append((seq, n))
        if n == 1 and seq.num_generated:
            plan.decode_tokens += 1
        else:
            plan.prompt_tokens += n
        if not seq.t_scheduled:
            seq.t_scheduled = time.monotonic()

    def _reserve(self, seq: Sequence, n: int, unscheduled: set[int], shrink: bool = False) -> int:
        """Count cells for n tokens of seq (fewer for a prompt chunk when `shrink` and memory is
        short), evicting cache entries, then preempting the worst sequence not yet fed this step
        (possibly seq itself), until they fit. Returns the tokens reserved; 0 if seq was preempted."""
        if seq.status is not Status.RUNNING:
            return 0
        while self.pool.free < n:
            if self.cache.evict_one():
                continue
            if shrink and self.pool.free > 0:
                n = self.pool.free
                break
            victim = max((s for s in self.running if id(s) in unscheduled), key=self.key)
            self._preempt(victim, park=False)
            unscheduled.discard(id(victim))
            if victim is seq:
                return 0
        self.pool.grow(seq, n)
        return n

    def _rollback(self, plan: StepPlan) -> None:
        for seq, n in plan.scheduled:
            seq.draft = []
            if seq.seq_id >= 0:
                self.pool.uncount(seq, len(seq.cells) - n)

    def _reap(self) -> None:
        """Finish cancelled sequences, and waiting ones whose lane made no progress for the queue
        timeout: stuck, not busy. Counted from arrival, it failed requests that waited while every
        prompt ahead of them was being read (six agents at once: two timed out after 600 s)."""
        for seq in [s for s in self.running if s.cancelled]:
            self.finish(seq, "cancelled")
        if not len(self.lanes):
            return
        for seq in [s for s in self.lanes if s.cancelled]:
            self.finish(seq, "cancelled")
        now = time.monotonic()
        if now >= self._next_timeout_check:
            self._next_timeout_check = now + 1.0
            for seq in [s for s in self.lanes if s.queued and self.stalled_s(s, now) > self.queue_timeout]:
                self.finish(seq, "error", OverloadedError(
                    f"timed out waiting in the queue: its lane made no progress for {self.queue_timeout:g} s"))

    def stalled_s(self, seq: Sequence, now: float) -> float:
        """Seconds a waiting request has waited with no step feeding its lane (the queue timeout's
        measure); the dashboard shows it beside the prompt's progress."""
        return now - max(seq.t_submit, self.lane_progress.get(seq.request.lane, 0.0))
