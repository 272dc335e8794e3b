"""Scheduler unit tests over the fake backend: batching correctness, budgets, lanes, preemption,
prefix cache, and randomised schedules that check no request is lost and no KV cell leaks."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_backend import FakeBackend
from localserve.batching.kvpool import KVPool
from localserve.batching.lanes import STRETCH
from scheduler_harness import Harness, alone


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 64) for _ in range(n)]


def test_batched_output_equals_each_request_alone():
    rng = random.Random(1)
    prompts = [_prompt(rng, n) for n in (1, 3, 17, 64, 150, 301, 5, 90)]
    h = Harness(FakeBackend(n_ctx=4096, n_batch=48, n_seq_max=16), max_sequences=8)
    results = [h.submit(p, max_tokens=20) for p in prompts]
    h.run()
    for p, r in zip(prompts, results):
        assert r.tokens == alone(p, 20)
        assert r.finish_reason == "length" and len(r.tokens) == 20
    h.assert_drained()


def test_every_batch_respects_the_budget_and_long_prompts_are_chunked():
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64), batch_tokens=40)
    decoder = h.submit([1, 2, 3], max_tokens=200)
    h.step()
    h.step()  # decoder now decodes one token per step
    long = h.submit(list(range(1, 64)) * 8, max_tokens=4)  # 504 tokens: 13+ steps at 40 per step
    steps_with_decoder = 0
    while long.finish_reason is None:
        plan = h.step()
        assert len(plan.batch) <= 40
        steps_with_decoder += any(t.seq_id == decoder.seq.seq_id for t in plan.batch)
        assert decoder.finish_reason is None
    # The running stream advanced at every step of the long prefill but the one that ended it,
    # which it sat out (Scheduler._sit_out): it never stalled.
    assert steps_with_decoder == h.sched.step - 3
    assert max(len(b) for b in h.backend.batches) == 40
    h.run()
    h.assert_drained()


def test_preemption_under_kv_pressure_keeps_outputs_exact():
    rng = random.Random(2)
    prompts = [_prompt(rng, rng.randrange(20, 80)) for _ in range(10)]
    # 10 sequences growing to ~100 tokens each cannot all fit 400 cells.
    h = Harness(FakeBackend(n_ctx=400, n_batch=64, n_seq_max=16), max_sequences=8)
    results = [h.submit(p, max_tokens=40, lane=rng.choice(["batch", "default"])) for p in prompts]
    h.run()
    assert h.sched.preemptions > 0
    for p, r in zip(prompts, results):
        assert r.tokens == alone(p, 40)
    h.assert_drained()


def test_kv_full_from_decode_preempts_and_retries():
    h = Harness(FakeBackend(n_ctx=2048, n_batch=64))
    rs = [h.submit([5, 6, 7, i + 1], max_tokens=12) for i in range(4)]
    calls = {"n": 0}

    def full_once_in_a_while(batch):
        calls["n"] += 1
        return calls["n"] % 5 == 3

    h.backend.kv_full_when = full_once_in_a_while
    h.run()
    for i, r in enumerate(rs):
        assert r.tokens == alone([5, 6, 7, i + 1], 12)
    h.assert_drained()


def test_backend_error_fails_only_that_batch():
    h = Harness(FakeBackend(n_ctx=2048, n_batch=64))
    bad = h.submit([9] * 10, max_tokens=5)
    h.backend.fail_when = lambda batch: any(t.seq_id == bad.seq.seq_id for t in batch)
    good_later = None
    h.step()  # bad fails here with everything else in its batch
    assert bad.finish_reason == "error" and bad.usage is not None
    h.backend.fail_when = None
    good_later = h.submit([9] * 10, max_tokens=5)
    h.run()
    assert good_later.finish_reason == "length" and good_later.tokens == alone([9] * 10, 5)
    h.assert_drained()


def test_interactive_request_is_not_delayed_by_a_flood_of_batch_requests():
    rng = random.Random(3)
    budget = 64
    prompt = _prompt(rng, 100)  # two prefill chunks on an idle engine
    idle = Harness(FakeBackend(n_ctx=8192, n_batch=budget, n_seq_max=32), max_sequences=8)
    r = idle.submit(prompt, max_tokens=4, lane="interactive")
    idle.run()
    idle_steps = r.first_token_step

    h = Harness(FakeBackend(n_ctx=8192, n_batch=budget, n_seq_max=32), max_sequences=8)
    for _ in range(40):
        h.submit(_prompt(rng, rng.randrange(30, 200)), max_tokens=60, lane="batch")
    for _ in range(10):
        h.step()  # the batch lane now fills every slot and the step budget
    start = h.sched.step
    r = h.submit(prompt, max_tokens=4, lane="interactive")
    while r.first_token_step is None:
        h.step()
    assert r.first_token_step - start <= idle_steps + 2
    assert r.tokens[:1] == alone(prompt, 4)[:1]
    h.run()
    assert r.tokens == alone(prompt, 4)
    h.assert_drained()


def test_batch_decoders_sit_out_the_steps_that_carry_a_better_lanes_prompt():
    rng = random.Random(12)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=16), max_sequences=4)
    jobs = [h.submit(_prompt(rng, 10), max_tokens=30, ignore_eos=True, lane="batch") for _ in range(3)]
    while any(not r.tokens for r in jobs):
        h.step()  # the batch decodes now
    chat = h.submit(_prompt(rng, 100), max_tokens=4, lane="interactive")  # two chunks of 64
    prefill_steps = 0
    while not chat.tokens:
        fed = {seq.request_id: n for seq, n in h.step().scheduled}
        prefill_steps += fed.get(chat.seq.request_id, 0) > 0
        # The chat's prompt chunks run alone: no batch row lengthens the step its first token waits for.
        assert not any(r.seq.request_id in fed for r in jobs) or chat.seq.request_id not in fed
    assert prefill_steps == 2
    fed = {seq.request_id: n for seq, n in h.step().scheduled}
    assert all(fed.get(r.seq.request_id) == 1 for r in jobs)  # back with the chat's decode
    h.run()
    for r in [*jobs, chat]:
        assert r.tokens == alone(r.seq.request.prompt_tokens, r.seq.request.max_tokens)
    h.assert_drained()


def test_batch_prompts_take_a_small_share_of_steps_while_interactive_streams_decode():
    rng = random.Random(10)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=16), max_sequences=4)
    chat = [h.submit(_prompt(rng, 10), max_tokens=40, ignore_eos=True, lane="interactive") for _ in range(2)]
    while any(not r.tokens for r in chat):
        h.step()  # both streams are decoding now
    job = h.submit(_prompt(rng, 300), max_tokens=5, lane="batch")
    same_lane = h.submit(_prompt(rng, 120), max_tokens=5, lane="interactive")
    chunks, peer_chunks = [], []
    while not job.tokens:
        plan = h.step()
        fed = dict((seq.request_id, n) for seq, n in plan.scheduled)
        if any(fed.get(r.seq.request_id) == 1 for r in chat):  # an interactive stream decoded
            chunks.append(fed.get(job.seq.request_id, 0))
            peer_chunks.append(fed.get(same_lane.seq.request_id, 0))
    # The batch job's prompt advances every step, 16 tokens (a quarter of the budget) at most;
    # a prompt of the decoding lane itself is not held back.
    assert chunks and max(chunks) <= 16 and sum(chunks) > 0
    assert max(peer_chunks) > 16
    h.run()
    assert job.tokens == alone(job.seq.request.prompt_tokens, 5)
    h.assert_drained()


def test_a_steady_interactive_stream_does_not_starve_the_batch_lane():
    rng = random.Random(4)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=32, n_seq_max=8), max_sequences=2, aging_steps=16)
    victim = h.submit(_prompt(rng, 20), max_tokens=10, lane="batch")
    for step in range(2000):
        # Always more interactive work than slots: without aging the batch request never runs.
        if len(h.sched.lanes) < 4:
            h.submit(_prompt(rng, 20), max_tokens=8, lane="interactive")
        h.step()
        if victim.finish_reason:
            break
    assert victim.finish_reason == "length"
    assert victim.tokens == alone(victim.seq.request.prompt_tokens, 10)


def test_prefix_cache_reuses_a_finished_requests_prefix():
    rng = random.Random(5)
    system = _prompt(rng, 200)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64))
    first = h.submit(system + [1, 2, 3], max_tokens=8)
    h.run()
    second = h.submit(system + [4, 5, 6, 7], max_tokens=8)
    h.run()
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 200
    assert second.tokens == alone(system + [4, 5, 6, 7], 8)
    # A fully cached prompt still recomputes its last two tokens: the last one's logits are
    # needed, and a one-token rest would run through other kernels than the uncached prompt.
    third = h.submit(system + [4, 5, 6, 7], max_tokens=8)
    h.run()
    assert third.usage.cached_tokens == 202 and third.tokens == second.tokens
    assert h.sched.cache.hits == 402
    h.assert_drained()


def test_next_chat_turn_takes_over_the_parked_conversation_without_a_copy():
    rng = random.Random(8)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64, prefix_sharing="copy"), max_sequences=4)
    copies = []
    real_copy = h.backend.kv_copy
    h.backend.kv_copy = lambda *a: (copies.append(a), real_copy(*a))
    turn1 = _prompt(rng, 80)
    first = h.submit(turn1, max_tokens=12, ignore_eos=True)
    h.run()
    (entry,) = h.sched.cache.parked.values()
    assert entry.seq_id == 0  # parked where it ran: nothing moved
    turn2 = turn1 + first.tokens + _prompt(rng, 10)
    second = h.submit(turn2, max_tokens=8)
    h.run()
    # Everything the first turn computed is reused (its last sampled token was never fed).
    assert second.usage.cached_tokens == 80 + 12 - 1
    assert second.tokens == alone(turn2, 8)
    assert copies == []
    h.assert_drained()


def test_parked_entries_on_running_ids_move_up_when_the_ids_are_needed():
    rng = random.Random(9)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=8, prefix_sharing="copy"), max_sequences=4)
    done = [h.submit(_prompt(rng, 20 + i), max_tokens=4) for i in range(4)]
    h.run()
    assert len(h.sched.cache.parked) == 4 and min(h.sched.cache.parked) < 4  # parked in place
    busy = [h.submit(_prompt(rng, 30), max_tokens=30, ignore_eos=True) for _ in range(4)]
    while len(h.sched.running) < 4:
        h.step()
    # Four new requests need ids 0..3: the entries moved above the running range, none was lost.
    assert sorted(q.seq_id for q in h.sched.running) == [0, 1, 2, 3]
    assert sorted(h.sched.cache.parked) == [4, 5, 6, 7]
    h.run()
    assert all(r.tokens == alone(r.seq.request.prompt_tokens, len(r.tokens)) for r in done + busy)
    h.assert_drained()


def test_prefix_cache_shares_a_running_sequences_cells():
    rng = random.Random(6)
    system = _prompt(rng, 120)
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64))
    a = h.submit(system + [1], max_tokens=30)
    for _ in range(4):
        h.step()  # a is decoding now
    used = h.backend.used_cells
    b = h.submit(system + [2, 3], max_tokens=30)
    h.step()
    # b's 120-token prefix is shared with a, not stored twice: b's step added only its own 2 tokens
    # (a sat that step out: it ended b's prompt, Scheduler._sit_out).
    assert h.backend.used_cells == used + 2
    h.run()
    assert b.usage.cached_tokens == 120
    assert a.tokens == alone(system + [1], 30) and b.tokens == alone(system + [2, 3], 30)
    h.assert_drained()


def test_prefix_cache_off_computes_everything():
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64), prefix_cache=False)
    h.submit([3] * 50, max_tokens=4)
    h.run()
    r = h.submit([3] * 50, max_tokens=4)
    h.run()
    assert r.usage.cached_tokens == 0 and not h.sched.cache.parked
    h.assert_drained()


def test_parked_entries_are_evicted_when_ids_run_out():
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=4), max_sequences=2)
    rs = []
    for i in range(12):
        rs.append(h.submit([i + 1] * 10, max_tokens=3))
        h.run()
    assert len(h.sched.cache.parked) <= 4
    assert all(r.finish_reason == "length" for r in rs)
    h.assert_drained()


def test_cancel_frees_the_sequence_at_the_next_step():
    h = Harness(FakeBackend(n_ctx=4096, n_batch=16))
    prefilling = h.submit(list(range(1, 60)), max_tokens=10)
    decoding = h.submit([1, 2], max_tokens=100)
    h.step()
    h.step()
    assert prefilling.seq.num_computed < 59  # still mid-prefill
    prefilling.seq.cancelled = True
    decoding.seq.cancelled = True
    h.step()
    assert prefilling.finish_reason == "cancelled" and decoding.finish_reason == "cancelled"
    assert not h.sched.running
    assert prefilling.usage.completion_tokens == 0
    h.assert_drained()


def test_cancelled_while_waiting_never_runs():
    h = Harness(FakeBackend(n_ctx=4096, n_batch=16), max_sequences=1)
    h.submit([1, 2, 3], max_tokens=50)
    waiting = h.submit([4, 5, 6], max_tokens=50)
    h.step()
    waiting.seq.cancelled = True
    h.step()
    assert waiting.finish_reason == "cancelled" and waiting.seq.seq_id == -1
    h.run()
    h.assert_drained()


def test_stop_strings_eog_and_context_limit_finish():
    # Find what the fake model says, then stop on a piece of it that spans tokens.
    prompt = [8, 5, 12, 12, 15]
    reference = Harness(FakeBackend())
    ref = reference.submit(prompt, max_tokens=12)
    reference.run()
    stop = ref.text[3:7]
    h = Harness(FakeBackend())
    r = h.submit(prompt, max_tokens=12, stop=[stop])
    h.run()
    assert r.finish_reason == "stop" and stop not in r.text and ref.text.startswith(r.text)

    eog = Harness(FakeBackend(eog_every=3))
    r = eog.submit(prompt, max_tokens=500)
    eog.run()
    assert r.finish_reason == "stop" and 0 not in r.tokens

    ctx = Harness(FakeBackend(n_ctx=64, n_batch=64))
    r = ctx.submit([1] * 60, max_tokens=500)
    ctx.run()
    assert r.finish_reason == "length" and len(r.tokens) == 4
    ctx.assert_drained()


def test_seeded_sampling_is_reproducible_inside_a_batch():
    def run(others: int) -> list[int]:
        h = Harness(FakeBackend(n_ctx=4096, n_batch=64))
        for i in range(others):
            h.submit([i + 1] * (i + 3), max_tokens=20, temperature=0.9)
        r = h.submit([7, 7, 7], max_tokens=20, temperature=0.9, seed=1234)
        h.run()
        return r.tokens

    assert run(0) == run(5) == run(9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_random_schedules_lose_nothing_and_leak_nothing(seed):
    rng = random.Random(seed)
    backend = FakeBackend(
        n_ctx=rng.choice([128, 256, 1024]),
        n_batch=rng.choice([8, 16, 64]),
        n_seq_max=rng.choice([2, 4, 9]),
        eog_every=rng.choice([0, 7, 50]),
        prefix_sharing="share" if rng.random() < 0.7 else "copy",
    )
    h = Harness(
        backend,
        max_sequences=rng.randint(1, 6),
        prefix_cache=rng.random() < 0.7,
        aging_steps=rng.choice([4, 64]),
    )
    shared = _prompt(rng, 40)
    pending = rng.randint(5, 25)
    failing = rng.random() < 0.3
    steps = 0
    while pending or h.sched.has_work():
        if pending and rng.random() < 0.4:
            pending -= 1
            n = rng.randint(1, min(90, h.sched.n_ctx_seq - 1))
            prompt = (shared[: rng.randint(0, 40)] + _prompt(rng, n))[:n]
            h.submit(prompt, max_tokens=rng.randint(1, 30), lane=rng.choice(["interactive", "default", "batch"]),
                     stop=rng.choice([[], ["ab"], ["é"]]))
        live = [r for r in h.results.values() if r.finish_reason is None]
        if live and rng.random() < 0.1:
            rng.choice(live).seq.cancelled = True
        if failing:
            backend.fail_when = (lambda b: True) if rng.random() < 0.05 else None
            backend.kv_full_when = (lambda b: True) if rng.random() < 0.05 else None
        h.step()
        steps += 1
        assert steps < 20_000
    h.assert_drained()
    for r in h.results.values():
        assert r.finish_reason in ("stop", "length", "cancelled", "error")
        if r.finish_reason == "length":
            assert len(r.tokens) == r.seq.request.max_tokens or len(r.seq.tokens) >= h.sched.n_ctx_seq
        if r.finish_reason in ("stop", "length") and not failing:
            prompt = r.seq.request.prompt_tokens
            assert r.tokens == alone(prompt, r.seq.request.max_tokens, backend.eog_every, stop=r.seq.request.stop)[: len(r.tokens)]


def test_step_count_is_bounded_by_work():
    """No busy steps: an empty scheduler has no work and schedules nothing."""
    h = Harness(FakeBackend())
    assert not h.sched.has_work()
    plan = h.step()
    assert not plan.batch


def test_queue_timeout_counts_time_without_progress_on_the_lane_not_time_since_arrival():
    h = Harness(FakeBackend(n_ctx=4096, n_batch=16), max_sequences=1, queue_timeout=0.05, aging_steps=100_000)
    running = h.submit([1, 2, 3], max_tokens=10_000)
    behind = h.submit([4, 5, 6], max_tokens=5)  # its lane decodes `running` every step: busy
    stuck = h.submit([7, 8, 9], max_tokens=5, lane="batch")  # no slot and no step for its lane
    h.step()
    for r in (behind, stuck):
        r.seq.t_submit -= 1.0  # both have now waited a second
    h.sched._next_timeout_check = 0.0
    h.step()
    assert stuck.finish_reason == "error" and "no progress" in stuck.seq.error.message
    assert stuck.seq.error.http_status == 503  # typed: the server is busy, a retry may succeed
    assert behind.finish_reason is None and running.finish_reason is None
    # The same request once its lane stops moving (its last step a second ago): stuck, timed out.
    h.sched.lane_progress["default"] -= 1.0
    h.sched._next_timeout_check = 0.0
    h.step()
    assert behind.finish_reason == "error" and "no progress" in behind.seq.error.message
    assert running.finish_reason is None  # a running request never times out of the queue
    running.seq.cancelled = True
    h.run()
    h.assert_drained()


def test_a_short_prompt_behind_a_long_one_generates_before_the_long_prompt_is_read():
    rng = random.Random(21)
    long_prompt, short_prompt = _prompt(rng, 2000), _prompt(rng, 100)
    idle = Harness(FakeBackend(n_ctx=8192, n_batch=64))
    alone_short = idle.submit(short_prompt, max_tokens=4)
    idle.run()
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64))
    long = h.submit(long_prompt, max_tokens=4)
    for _ in range(5):
        h.step()  # the long prompt is being read
    start = h.sched.step
    short = h.submit(short_prompt, max_tokens=4)
    while short.first_token_step is None:
        h.step()
    assert long.first_token_step is None and long.seq.pending > 1000
    # As many steps as alone: the short prompt took the whole budget, not a share of it.
    assert short.first_token_step - start == alone_short.first_token_step
    h.run()
    assert short.tokens == alone(short_prompt, 4) and long.tokens == alone(long_prompt, 4)
    h.assert_drained()


def test_a_prompt_sharing_a_prefix_still_being_read_waits_for_it_instead_of_computing_it_again():
    """Eight requests with one system prompt arriving while the first is reading it (load C's first
    wave): each later one is due no earlier than the first, so it starts on the first's whole prefix
    and computes only its own tail, not the part the first was about to share."""
    rng = random.Random(23)
    system, budget = _prompt(rng, 1000), 64
    h = Harness(FakeBackend(n_ctx=16384, n_batch=budget, n_seq_max=16), max_sequences=8)
    prompts = [system + _prompt(rng, 20 + i) for i in range(8)]
    first = h.submit(prompts[0], max_tokens=2)
    for _ in range(8):
        h.step()  # 512 of its 1,020 tokens read: the others' cache hit is half of what they share
    rest = [h.submit(p, max_tokens=2) for p in prompts[1:]]
    assert all(r.seq.due_step >= first.seq.due_step for r in rest)
    h.run()
    prompt_rows = sum(len(batch) for batch in h.backend.batches) - 8  # less each one's decode of its 2nd token
    # The first's whole prompt, and of each other only what follows the shared prefix's last chunk.
    assert prompt_rows <= sum(len(p) for p in prompts) - 7 * (1000 - budget)
    assert all(r.tokens == alone(p, 2) for r, p in zip([first, *rest], prompts))
    h.assert_drained()


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    rng = random.Random(22)
    budget, long_tokens = 32, 640  # 20 steps alone
    h = Harness(FakeBackend(n_ctx=16384, n_batch=budget, n_seq_max=16), max_sequences=4)
    long = h.submit(_prompt(rng, long_tokens), max_tokens=2)
    shorts = []
    while long.first_token_step is None:
        # Always a fresh short prompt waiting, due before the long one until it is late.
        if sum(r.seq.status.value == "waiting" for r in shorts) < 2:
            shorts.append(h.submit(_prompt(rng, 40), max_tokens=2))
        h.step()
        assert h.sched.step < 500, "the long prompt starved"
    # Shorter prompts went first while it was not due; from its due step on, it came first.
    assert any(r.first_token_step is not None for r in shorts)
    assert long.first_token_step <= (STRETCH + 1) * (long_tokens // budget) + 4
    h.run()
    assert long.tokens == alone(long.seq.request.prompt_tokens, 2)
    h.assert_drained()


def test_per_sequence_streams_copy_prefixes_and_cap_each_sequence():
    rng = random.Random(7)
    system = _prompt(rng, 60)
    h = Harness(FakeBackend(n_ctx=1024, n_batch=64, n_seq_max=8, prefix_sharing="copy"), max_sequences=4)
    assert h.sched.n_ctx_seq == 128  # each sequence's own stream
    a = h.submit(system + [1], max_tokens=20)
    for _ in range(3):
        h.step()
    b = h.submit(system + [2, 3], max_tokens=200)  # copies a's prefix, then runs into its stream's end
    h.run()
    assert b.usage.cached_tokens == 60 and b.finish_reason == "length" and len(b.seq.tokens) == 128
    assert a.tokens == alone(system + [1], 20) and b.tokens == alone(system + [2, 3], 200)[: len(b.tokens)]
    h.assert_drained()


def test_kv_pool_block_is_the_cheapest_consecutive_window():
    pool = KVPool(FakeBackend(n_ctx=4096, n_seq_max=16).capabilities, 4096, 16, n_running=8)
    assert pool.block([3, 4, 5], [0, 1]) == range(3, 6)  # already consecutive: nothing moves
    assert pool.block([0, 1, 5], [2]) == range(0, 3)  # one move in, one parked entry out
    assert pool.block([0, 6, 7], [1, 2, 3, 4]) == range(5, 8)  # one move, no entry disturbed
    assert pool.block([], [0]) == range(0, 0)


def _frozen_clock(h: Harness, s_per_decode: float, s_per_prompt: float) -> None:
    """Step costs as if measured on a slow machine, kept fixed: the fake backend's own (real, tiny)
    timings must not move them, so the test does not depend on how fast this machine is."""
    clock = h.sched.clock
    clock.observe(8, 0, 8 * s_per_decode)
    clock.observe(8, 100, 8 * s_per_decode + 100 * s_per_prompt)
    clock.observe = lambda *args: None


def test_batch_lane_chunks_fit_the_step_time_target():
    # 2.5 ms per prompt token: the 50 ms default target is 20 tokens of batch-lane prompt per step,
    # whatever the token budget; a default-lane prompt still takes the whole budget.
    rng = random.Random(11)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=256, n_seq_max=16), max_sequences=4)
    _frozen_clock(h, 0.005, 0.0025)
    assert h.sched.clock.prompt_tokens_within(256) == 20
    jobs = [h.submit(_prompt(rng, 200), max_tokens=5, lane="batch") for _ in range(2)]
    peer = h.submit(_prompt(rng, 200), max_tokens=5, lane="default")
    batch_per_step, peer_chunks = [], []
    while not all(r.tokens for r in jobs):
        prefilling = [r for r in jobs if not r.tokens]  # the others decode one token a step
        plan = h.step()
        fed = {seq.request_id: n for seq, n in plan.scheduled}
        batch_per_step.append(sum(fed.get(r.seq.request_id, 0) for r in prefilling))
        peer_chunks.append(fed.get(peer.seq.request_id, 0))
    # Both batch prompts together stay within the target every step, and still advance.
    assert max(batch_per_step) <= 20 and sum(batch_per_step) >= 400
    assert max(peer_chunks) > 20
    h.run()
    for r in [*jobs, peer]:
        assert r.tokens == alone(r.seq.request.prompt_tokens, 5)
    h.assert_drained()


def test_a_batch_prompt_still_advances_when_the_time_target_allows_less_than_a_valid_chunk():
    # A busy machine measured 36 ms a prompt token: the 50 ms target allows one token, raised to
    # min_chunk (2). A 3-token prompt cannot be cut into 2 + a lone 1 (min_chunk), so it got no
    # chunk at all; with only such prompts running nothing was fed and the engine spun without a
    # step (seen: 15 million empty steps on a daemon's warm-up batch).
    h = Harness(FakeBackend(n_ctx=4096, n_batch=64, n_seq_max=8, min_chunk=2), max_sequences=4)
    _frozen_clock(h, 0.008, 0.036)
    assert h.sched.clock.prompt_tokens_within(64) == 1
    jobs = [h.submit([5 + i, 6, 7], max_tokens=3, lane="batch") for i in range(3)]
    for _ in range(50):
        if all(r.finish_reason for r in jobs):
            break
        h.step()
    assert all(r.finish_reason == "length" for r in jobs)
    for r in jobs:
        assert r.tokens == alone(r.seq.request.prompt_tokens, 3)
    h.assert_drained()


def test_no_time_target_before_any_step_is_measured_or_when_it_is_off():
    from localserve.batching.step_clock import StepClock

    assert StepClock().prompt_tokens_within(256) == 256  # nothing measured yet
    off = StepClock(target_s=0)
    off.observe(0, 100, 1.0)
    assert off.prompt_tokens_within(256) == 256
    slow = StepClock(target_s=0.05)
    slow.observe(0, 100, 10.0)  # 0.1 s a token: one token per step, never none
    assert slow.prompt_tokens_within(256) == 1
    # As long as the step's decodes take, when that is more than the target: 8 decoders of
    # 0.1 s give a chunk 0.8 s, 8 tokens.
    slow.observe(8, 0, 0.8)
    assert slow.prompt_tokens_within(256, decoders=8) == 8


def test_batch_work_alone_gets_long_steps_on_an_interruptible_backend():
    # The 50 ms target bounds what a batch step adds to an interactive arrival's wait. A backend
    # that can stop a step for the arrival (Backend.interrupt) lets batch work alone run ten times
    # longer steps (big chunks cost less per token); while an interactive stream decodes, the
    # target holds again, since its next token waits for the whole step.
    from localserve.batching.step_clock import StepClock

    clock = StepClock(target_s=0.05)
    clock.observe(0, 100, 0.25)  # 2.5 ms a prompt token
    assert (clock.prompt_tokens_within(512), clock.prompt_tokens_within(512, interruptible=True)) == (20, 200)

    rng = random.Random(12)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=256, n_seq_max=16, interruptible=True), max_sequences=4)
    _frozen_clock(h, 0.005, 0.0025)
    job = h.submit(_prompt(rng, 400), max_tokens=40, lane="batch")
    plan = h.step()
    assert plan.interruptible and plan.scheduled == [(job.seq, 200)]
    h.step()
    chat = h.submit(_prompt(rng, 30), max_tokens=20, lane="interactive")
    batch_chunks = []
    while not chat.finish_reason:
        plan = h.step()
        fed = {seq.request_id: n for seq, n in plan.scheduled}
        # No arrival stops a step that carries interactive work for less than it: the chat's own
        # prompt step yields only to a prompt read before the chat's (step_plan.py).
        assert not plan.interruptible or plan.yields_to == h.sched.prompt_key(chat.seq)[:2]
        batch_chunks.append(fed.get(job.seq.request_id, 0))
    assert 0 < max(batch_chunks) <= 20
    h.run()
    assert job.tokens == alone(job.seq.request.prompt_tokens, 40)
    assert chat.tokens == alone(chat.seq.request.prompt_tokens, 20)
    h.assert_drained()


def test_batch_prompts_alone_go_whole_or_wait_for_a_step_of_their_own():
    # Alone on an interruptible backend a batch prompt is never cut to fit beside another: it goes
    # whole, or waits for the next step, where it comes first (a cut costs a micro-batch).
    rng = random.Random(14)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=256, n_seq_max=16, interruptible=True), max_sequences=4)
    _frozen_clock(h, 0.005, 0.0025)  # time room: 200 tokens
    jobs = [h.submit(_prompt(rng, 150), max_tokens=4, lane="batch") for _ in range(3)]
    fed = [[n for seq, n in h.step().scheduled if seq.num_generated == 0 or n > 1] for _ in range(3)]
    assert fed == [[150], [150], [150]]  # 150 + a 106-token cut of the next would fit the budget
    h.run()
    for r in jobs:
        assert r.tokens == alone(r.seq.request.prompt_tokens, 4)
    h.assert_drained()


def test_a_step_of_prompt_rows_alone_yields_only_to_a_prompt_read_before_it():
    # Issue 48: a 600-token prompt arriving 1 s behind a 7,500-token one waited out the long one's
    # chunk in flight. A step of prompt rows alone (no stream waits on a token) now stops for an
    # arrival that prompt order puts first, and for no other: a longer prompt would only be
    # delayed by a redone chunk.
    from localserve.batching.lanes import arrival_key

    rng = random.Random(15)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=16, interruptible=True), max_sequences=4)
    long = h.submit(_prompt(rng, 1200), max_tokens=4)
    plan = h.step()
    assert plan.interruptible and plan.yields_to == (1, long.seq.due_step)
    step, budget = h.sched.step, h.sched.budget
    assert arrival_key(1, 100, step, budget) < plan.yields_to  # a short prompt of the lane goes first
    assert arrival_key(0, 2000, step, budget) < plan.yields_to  # and any interactive one
    assert not arrival_key(1, 2000, step, budget) < plan.yields_to  # a longer one does not
    done = long.seq.num_computed
    h.backend.interrupt()  # the short one's arrival during the next step, as the engine signals it
    assert h.step().interruptible and h.sched.interrupted_steps == 1
    assert long.seq.num_computed == done  # the long chunk was stopped: it is planned again
    h.backend.clear_interrupt()
    short = h.submit(_prompt(rng, 100), max_tokens=4)
    plan = h.step()
    assert plan.scheduled[0] == (short.seq, 64) and plan.interruptible
    while not short.tokens:
        h.step()
    plan = h.step()  # the short one's next token beside the long one's chunk
    assert plan.decode_tokens == 1 and not plan.interruptible  # a stream waits on it: no one stops it
    h.run()
    assert long.tokens == alone(long.seq.request.prompt_tokens, 4)
    assert short.tokens == alone(short.seq.request.prompt_tokens, 4)
    h.assert_drained()


def test_an_interrupted_step_is_planned_again_and_answers_stay_exact():
    # The backend stopped a step of batch work (an interactive request arrived): nothing of it was
    # kept, so the scheduler forgets the step's cells and plans the work again.
    rng = random.Random(13)
    h = Harness(FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=16, interruptible=True), max_sequences=4)
    jobs = [h.submit(_prompt(rng, 90), max_tokens=6, lane="batch") for _ in range(3)]
    h.step()
    used = h.backend.used_cells
    h.backend.interrupt()
    plan = h.step()
    assert plan.interruptible and h.sched.interrupted_steps == 1
    assert h.backend.used_cells == used and h.sched.pool.used == used  # the books match the backend
    assert all(not r.tokens for r in jobs)
    h.backend.clear_interrupt()
    h.run()
    assert h.sched.interrupted_steps == 1
    for r in jobs:
        assert r.tokens == alone(r.seq.request.prompt_tokens, 6)
    h.assert_drained()
