"""Drives a Scheduler over any Backend synchronously, step by step, checking the invariants
that must hold after every step (shared by the scheduler test modules). The fake backend is the
default; tests/model/test_scheduler_backends.py runs the same harness over llama.cpp and ONNX Runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Iterator

from localserve.backends.base import Backend, declared_capabilities
from localserve.batching.kv_ops import KVCopy, KVMove, KVOp, KVRemove
from localserve.batching.limits import EngineLimits
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.batching.scheduler import Scheduler
from localserve.batching.sequence import Sequence, Status
from localserve.engine import step

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


def used_cells(backend: Backend) -> int:
    """KV cells the backend holds, read from the backend itself (not from our accounting)."""
    if isinstance(backend, FakeBackend):
        return backend.used_cells
    slots = getattr(backend, "slots", None)  # ONNX: its slot table counts slots held by anyone
    if slots is not None:
        return slots.used
    # llama.cpp has no cell count; with per-sequence streams ("copy") each id's cells are its own
    # positions 0..pos_max (only tails are ever removed), so the sum is exact. A unified llama.cpp
    # pool shares copied prefixes: no sum can say how many cells that is.
    if backend.capabilities.prefix_sharing != "copy":
        raise TypeError(f"cannot count the cells of {type(backend).__name__} with a shared pool")
    return sum(backend.kv_pos_max(i) + 1 for i in range(backend.capabilities.max_seqs))


def live_seq_ids(backend: Backend) -> set[int]:
    return {i for i in range(backend.capabilities.max_seqs) if backend.kv_pos_max(i) >= 0}


_SPIED = ("decode", "kv_remove", "kv_copy", "kv_move")
_OP_METHOD = {KVRemove: "kv_remove", KVCopy: "kv_copy", KVMove: "kv_move"}


def as_call(op: KVOp) -> tuple[str, tuple]:
    """The backend call an operation stands for, as backend_calls records it."""
    return _OP_METHOD[type(op)], dataclasses.astuple(op)


@contextlib.contextmanager
def backend_calls(backend: Backend) -> Iterator[list[tuple[str, tuple, str]]]:
    """Record the backend's decode and KV calls as (method, args, module of the caller), the
    outermost only (a kv_move made of a copy and a remove is one move), while the block runs."""
    calls: list[tuple[str, tuple, str]] = []
    depth = 0

    def spying(name: str):
        real = getattr(backend, name)

        def spy(*args, **kwargs):
            nonlocal depth
            if depth == 0:
                calls.append((name, args, sys._getframe(1).f_globals.get("__name__", "?")))
            depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth -= 1
        return spy

    for name in _SPIED:
        setattr(backend, name, spying(name))
    try:
        yield calls
    finally:
        for name in _SPIED:
            delattr(backend, name)


class Harness:
    def __init__(self, backend: Backend | None = None, foreign: frozenset[int] = frozenset(), **limits):
        """`foreign`: sequence ids a test fills behind the scheduler's back (cells the scheduler
        cannot know about); the invariants leave them out."""
        self.backend = backend or FakeBackend()
        caps = self.backend.capabilities
        self.foreign = foreign
        defaults = dict(max_sequences=8, batch_tokens=caps.max_batch_tokens, n_ctx=caps.kv_cells,
                        n_ctx_seq=caps.kv_cells_per_seq, queue_size=1000)
        defaults.update(limits)
        self.limits = EngineLimits(**defaults)
        self.sched = Scheduler(declared_capabilities(self.backend), self.limits)
        self.results: dict[str, Result] = {}
        self.flushed: list[KVOp] = []  # the KV operations the last step's postprocess recorded

    def foreign_cells(self) -> int:
        return sum(self.backend.kv_pos_max(i) + 1 for i in self.foreign)

    def submit(self, prompt: list[int], max_tokens: int = 16, lane="default", stop=(), temperature=0.0, seed=None,
               ignore_eos=False, thinking=None, lora=()) -> Result:
        request = GenerationRequest(
            prompt_tokens=list(prompt), max_tokens=max_tokens, lane=lane, stop=list(stop),
            sampling=SamplingParams(temperature=temperature, seed=seed), ignore_eos=ignore_eos, thinking=thinking,
            lora=lora,
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
        output = s.postprocess(plan, step.run(self.backend, plan))
        # As the engine does: what the step released goes back now, so the cache can be checked
        # against the books after every step.
        self.flushed = output.kv_ops
        step.apply_kv_ops(self.backend, self.flushed)
        for seq in output.updated:
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
        caps = b.capabilities
        assert len(plan.batch) <= s.budget <= caps.max_batch_tokens
        # Our accounting matches the cache cell for cell, and no id is held by nobody.
        backend_cells = used_cells(b) - self.foreign_cells()
        assert s.pool.used == backend_cells, (s.pool.used, backend_cells)
        holders = {q.seq_id for q in s.running if q.seq_id >= 0} | set(s.cache.parked)
        live = live_seq_ids(b) - self.foreign
        assert live <= holders, (live, holders)
        assert s.pool.free_ids + len(holders) == caps.max_seqs
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
        step.apply_kv_ops(self.backend, self.sched.take_output().kv_ops)
        assert self.sched.pool.used == 0 and used_cells(self.backend) == self.foreign_cells()
        assert self.sched.pool.free_ids == self.backend.capabilities.max_seqs
        assert not live_seq_ids(self.backend) - self.foreign


def alone(prompt, max_tokens, eog_every=0, **kw) -> list[int]:
    """The greedy output of one request run by itself on a roomy scheduler."""
    h = Harness(FakeBackend(n_ctx=4096, n_batch=512, n_seq_max=4, eog_every=eog_every), prefix_cache=False)
    r = h.submit(prompt, max_tokens, **kw)
    h.run()
    return r.tokens
