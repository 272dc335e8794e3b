"""Drives a Scheduler over the fake backend synchronously, step by step, checking the invariants
that must hold after every step (shared by the scheduler test modules)."""

from __future__ import annotations

from dataclasses import dataclass, field

from localserve.batching.limits import EngineLimits
from localserve.requests import GenerationRequest, SamplingParams
from localserve.batching.scheduler import Scheduler
from localserve.batching.sequence import Sequence, Status

from fake_backend import FakeBackend


@dataclass
class Result:
    seq: Sequence
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finishes: int = 0
    finish_reason: str | None = None
    first_token_step: int | None = None
    usage: object = None


class Harness:
    def __init__(self, backend: FakeBackend | None = None, **limits):
        self.backend = backend or FakeBackend()
        defaults = dict(max_sequences=8, batch_tokens=self.backend.n_batch, n_ctx=self.backend.n_ctx,
                        n_ctx_seq=self.backend.n_ctx, queue_size=1000)
        defaults.update(limits)
        self.limits = EngineLimits(**defaults)
        self.sched = Scheduler(self.backend, self.limits)
        self.results: dict[str, Result] = {}

    def submit(self, prompt, max_tokens=16, lane="default", stop=(), temperature=0.0, seed=None,
               ignore_eos=False) -> Result:
        request = GenerationRequest(
            prompt_tokens=list(prompt), max_tokens=max_tokens, lane=lane, stop=list(stop),
            sampling=SamplingParams(temperature=temperature, seed=seed), ignore_eos=ignore_eos,
        )
        seq = Sequence(request, self.backend.new_sampler(request.sampling, request.prompt_tokens),
                       self.backend.token_to_bytes, self.backend.is_eog, self.sched.n_ctx_seq)
        self.sched.add(seq)
        result = self.results[request.request_id] = Result(seq)
        return result

    def step(self):
        plan = self.sched.schedule()
        # Each step runs the running sequences on consecutive ids when the backend declares it
        # needs them (llama.cpp's per-stream splitter batches only those together: kvpool.py).
        s = self.sched
        ids = sorted(q.seq_id for q in s.running)
        if ids and s.caps.consecutive_ids:
            assert ids == list(range(ids[0], ids[0] + len(ids))), ids
        if plan.batch:
            s.execute(plan)
        for seq in self.sched.updates:
            event = seq.take_event()
            if event is None:
                continue
            r = self.results[seq.request_id]
            if event.token_ids and r.first_token_step is None:
                r.first_token_step = self.sched.step
            r.tokens += event.token_ids
            r.text += event.text
            if event.finish_reason:
                r.finishes += 1
                r.finish_reason = event.finish_reason
                r.usage = event.usage
        self.sched.updates = []
        self.check_invariants(plan)
        return plan

    def run(self, max_steps=100_000):
        n = 0
        while self.sched.has_work():
            self.step()
            n += 1
            assert n < max_steps, "scheduler made no progress"

    def check_invariants(self, plan) -> None:
        s, b = self.sched, self.backend
        assert len(plan.batch) <= s.budget <= b.n_batch
        # Our accounting matches the cache cell for cell, and no id is held by nobody.
        assert s.pool.used == b.used_cells, (s.pool.used, b.used_cells)
        holders = {q.seq_id for q in s.running if q.seq_id >= 0} | set(s.cache.parked)
        assert b.live_seq_ids() <= holders, (b.live_seq_ids(), holders)
        assert s.pool.free_ids + len(holders) == b.n_seq_max
        assert len(s.running) <= s.max_running
        assert all(e.seq_id == k for k, e in s.cache.parked.items())
        for q in s.running:
            assert q.status is Status.RUNNING and q.seq_id >= 0
            assert b.kv_pos_max(q.seq_id) == q.num_computed - 1
        for entry in s.cache.parked.values():
            assert b.kv_pos_max(entry.seq_id) == len(entry.tokens) - 1

    def assert_drained(self) -> None:
        """Every request finished exactly once; clearing the cache frees every cell and id."""
        for r in self.results.values():
            assert r.finishes == 1, (r.seq.request_id, r.finishes)
        self.sched.cache.clear()
        assert self.sched.pool.used == 0 and self.backend.used_cells == 0
        assert self.sched.pool.free_ids == self.backend.n_seq_max
        assert not self.backend.live_seq_ids()


def alone(prompt, max_tokens, eog_every=0, **kw) -> list[int]:
    """The greedy output of one request run by itself on a roomy scheduler."""
    h = Harness(FakeBackend(n_ctx=4096, n_batch=512, n_seq_max=4, eog_every=eog_every), prefix_cache=False)
    r = h.submit(prompt, max_tokens, **kw)
    h.run()
    return r.tokens
