"""Adapter turns (batching/adapter_turns.py): a step runs one LoRA set, the backend runs each decode
with the plan's set, no set waits forever, and the prefix cache never serves cells computed under
another set. Over the fake backend, which records the set of every decode."""

from __future__ import annotations

from fake_backend import FakeBackend
from localserve.batching.adapter_turns import TURN_STEPS
from scheduler_harness import Harness

A = ((0, 1.0),)
B = ((1, 0.5),)
PROMPT = list(range(1, 13))


class AdapterBackend(FakeBackend):
    """The fake with adapters: it records the set each decode ran under."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.info.loras = ["a.gguf", "b.gguf"]
        self.current = ()
        self.decoded_under: list[tuple] = []

    def set_adapters(self, adapters) -> None:
        self.current = adapters

    def decode(self, batch, interruptible=False) -> None:
        self.decoded_under.append(self.current)
        super().decode(batch, interruptible)


def run_checked(h: Harness) -> list[tuple]:
    """Run to the end; every step feeds only sequences of its plan's set. Returns each step's set."""
    sets = []
    while h.sched.has_work():
        plan = h.step()
        if plan.batch:
            assert {seq.adapters for seq, _ in plan.scheduled} == {plan.adapters}
            sets.append(plan.adapters)
    return sets


def test_two_sets_alternate_by_turns_and_both_finish():
    backend = AdapterBackend(n_ctx=4096, n_batch=64, n_seq_max=8)
    h = Harness(backend)
    a = h.submit(PROMPT, max_tokens=3 * TURN_STEPS, lora=A)
    b = h.submit([40] + PROMPT, max_tokens=3 * TURN_STEPS, lora=B)
    sets = run_checked(h)
    assert a.finish_reason == b.finish_reason == "length" and len(a.tokens) == len(b.tokens) == 3 * TURN_STEPS
    assert backend.decoded_under == sets  # the engine's step switched the backend's set with the plan
    # One set at a time, each run for about a turn while the other waits: neither starves.
    runs = [sets[0]]
    for s in sets[1:]:
        if s != runs[-1]:
            runs.append(s)
    assert len(runs) >= 4
    assert max(len(list(g)) for g in _runs(sets)) <= TURN_STEPS + 1
    h.assert_drained()


def _runs(sets):
    start = 0
    for i in range(1, len(sets) + 1):
        if i == len(sets) or sets[i] != sets[start]:
            yield sets[start:i]
            start = i


def test_a_better_lanes_set_runs_at_the_next_step():
    h = Harness(AdapterBackend(n_ctx=4096, n_batch=64, n_seq_max=8))
    h.submit(PROMPT, max_tokens=40, lane="batch", lora=A)
    for _ in range(3):
        h.step()
    fast = h.submit([50] + PROMPT, max_tokens=4, lane="interactive", lora=B)
    plans = [h.step() for _ in range(4)]
    assert all(p.adapters == B for p in plans) and fast.finish_reason == "length"
    run_checked(h)
    h.assert_drained()


def test_the_prefix_cache_serves_only_cells_of_the_same_set():
    h = Harness(AdapterBackend(n_ctx=4096, n_batch=64, n_seq_max=8))
    h.submit(PROMPT, max_tokens=2, lora=A)
    run_checked(h)
    other = h.submit(PROMPT + [7, 8], max_tokens=2, lora=B)
    plain = h.submit(PROMPT + [7, 9], max_tokens=2)
    run_checked(h)
    same = h.submit(PROMPT + [7, 10], max_tokens=2, lora=A)
    run_checked(h)
    assert other.usage.cached_tokens == 0 and plain.usage.cached_tokens == 0
    assert same.usage.cached_tokens >= len(PROMPT) - 2
    h.assert_drained()
