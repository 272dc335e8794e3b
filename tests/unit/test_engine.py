"""Engine over the fake backend: the thread, the async streams, cancellation, queues, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
import pytest

from fake_backend import FakeBackend
from localserve.batching.limits import EngineLimits
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.engine.local import Engine, RequestStream
from localserve.errors import ContextLengthExceededError, InvalidRequestError, OverloadedError, QueueFullError
from scheduler_harness import alone


def _engine(backend: FakeBackend | None = None, **limits) -> Engine:
    backend = backend or FakeBackend(n_ctx=2048, n_batch=64, n_seq_max=16, step_time=0.001)
    defaults = dict(max_sequences=8, batch_tokens=backend.n_batch, n_ctx=backend.n_ctx, n_ctx_seq=backend.n_ctx)
    defaults.update(limits)
    engine = Engine(backend, EngineLimits(**defaults), name="fake")
    engine.start()
    return engine


def _request(prompt, max_tokens=10, **kw) -> GenerationRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0))
    return GenerationRequest(prompt_tokens=list(prompt), max_tokens=max_tokens, **kw)


def _thread_cpu(engine: Engine) -> float:
    native = engine._thread.native_id
    thread = next(t for t in psutil.Process().threads() if t.id == native)
    return thread.user_time + thread.system_time


async def _collect(stream: RequestStream):
    events = [event async for event in stream]
    tokens = [t for e in events for t in e.token_ids]
    return events, tokens


async def test_concurrent_requests_stream_their_own_tokens():
    engine = _engine()
    try:
        prompts = [[i + 1] * (3 + 20 * i) for i in range(6)]
        streams = [engine.submit(_request(p, 15)) for p in prompts]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        for p, (events, tokens) in zip(prompts, results):
            assert tokens == alone(p, 15)
            assert [e.finish_reason for e in events].count("length") == 1 and events[-1].finish_reason == "length"
            usage = events[-1].usage
            assert usage.prompt_tokens == len(p) and usage.completion_tokens == 15
            assert 0 <= usage.queue_s <= usage.ttft_s <= usage.total_s
        assert engine.active_requests() == 0
        stats = engine.stats()
        assert stats.steps > 0 and stats.kv_total == 2048 and stats.running == 0
        assert stats.max_sequences == 8 and stats.tokens_per_s > 0
        assert set(stats.to_dict()) >= {"running", "waiting", "kv_used", "tokens_per_s", "prefix_cache_hit_rate", "busy"}
    finally:
        engine.shutdown()


async def test_cancel_from_another_thread_and_by_id():
    engine = _engine(FakeBackend(n_ctx=4096, n_batch=32, step_time=0.005))
    try:
        long_prefill = engine.submit(_request([3] * 1000, 50))
        decoding = engine.submit(_request([1, 2], 10_000))
        by_id = engine.submit(_request([4, 5], 10_000))
        await asyncio.sleep(0.1)
        threading.Thread(target=long_prefill.cancel).start()
        threading.Thread(target=decoding.cancel).start()
        engine.cancel(by_id.request_id)
        for stream in (long_prefill, decoding, by_id):
            events, _ = await asyncio.wait_for(_collect(stream), 5)
            assert events[-1].finish_reason == "cancelled"
        assert engine.active_requests() == 0 and engine.stats().running == 0
    finally:
        engine.shutdown()


async def test_queue_full_raises_with_retry_after_and_other_lanes_still_accept():
    engine = _engine(FakeBackend(n_ctx=4096, n_batch=16, step_time=0.01), max_sequences=1, queue_size=2)
    try:
        streams = [engine.submit(_request([1, 2, 3], 1000, lane="batch"))]
        await asyncio.sleep(0.1)  # it runs in the one slot; the queue is empty again
        streams += [engine.submit(_request([1, 2, 3], 1000, lane="batch")) for _ in range(2)]
        with pytest.raises(QueueFullError) as info:
            engine.submit(_request([1, 2, 3], 1000, lane="batch"))
        assert info.value.retry_after >= 1.0 and info.value.http_status == 429
        streams.append(engine.submit(_request([1, 2, 3], 3, lane="interactive")))
        events, _ = await asyncio.wait_for(_collect(streams[-1]), 5)
        assert events[-1].finish_reason == "length"
        # The bound counts requests that never started: a batch request the interactive one
        # preempted may wait again (stats show it) but frees no place.
        with pytest.raises(QueueFullError):
            engine.submit(_request([1, 2, 3], 1000, lane="batch"))
    finally:
        engine.shutdown()
    for s in streams[:-1]:
        events, _ = await asyncio.wait_for(_collect(s), 5)
        assert events[-1].finish_reason == "cancelled"


async def test_submit_rejects_bad_requests_at_once():
    engine = _engine(FakeBackend(n_ctx=256, n_batch=64))
    try:
        with pytest.raises(ContextLengthExceededError):
            engine.submit(_request([1] * 256))
        with pytest.raises(InvalidRequestError):
            engine.submit(_request([]))
        with pytest.raises(InvalidRequestError):
            engine.submit(_request([1, 99999]))
        with pytest.raises(InvalidRequestError):
            engine.submit(_request([1], max_tokens=0))
        with pytest.raises(InvalidRequestError):
            engine.submit(_request([1], sampling=SamplingParams(grammar="invalid")))
        assert engine.n_ctx_per_seq == 256
        # None of the refused requests holds a queue place.
        assert engine.stats().waiting == {"interactive": 0, "default": 0, "batch": 0}
    finally:
        engine.shutdown()


async def test_backend_error_fails_only_the_requests_in_that_batch():
    backend = FakeBackend(n_ctx=2048, n_batch=64, step_time=0.001)
    engine = _engine(backend)
    try:
        backend.fail_when = lambda batch: any(t.token == 42 for t in batch)
        bad = engine.submit(_request([42, 42, 42], 5))
        events, _ = await asyncio.wait_for(_collect(bad), 5)
        assert events[-1].finish_reason == "error" and events[-1].error
        backend.fail_when = None
        good = engine.submit(_request([1, 2, 3], 5))
        events, tokens = await asyncio.wait_for(_collect(good), 5)
        assert events[-1].finish_reason == "length" and tokens == alone([1, 2, 3], 5)
    finally:
        engine.shutdown()


async def test_shutdown_cancels_everything_and_is_idempotent():
    engine = _engine(FakeBackend(n_ctx=4096, n_batch=16, step_time=0.005), max_sequences=2)
    streams = [engine.submit(_request([i + 1] * 5, 10_000)) for i in range(5)]
    await asyncio.sleep(0.05)
    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
    engine.shutdown()
    for s in streams:
        events, _ = await asyncio.wait_for(_collect(s), 5)
        assert events[-1].finish_reason == "cancelled"
    with pytest.raises(OverloadedError):
        engine.submit(_request([1]))
    assert engine.scheduler.pool.used == engine.backend.used_cells


async def test_engine_thread_sleeps_when_idle():
    engine = _engine()
    try:
        events, _ = await _collect(engine.submit(_request([1, 2], 3)))
        steps = engine.stats().steps
        cpu0 = _thread_cpu(engine)
        await asyncio.sleep(0.3)
        assert engine.stats().steps == steps and not engine.stats().busy
        assert _thread_cpu(engine) - cpu0 < 0.02  # asleep on its condition, not spinning
        # A late request still gets served after the idle period.
        events, tokens = await _collect(engine.submit(_request([1, 2], 3)))
        assert tokens == alone([1, 2], 3)
    finally:
        engine.shutdown()


async def test_the_event_loop_never_blocks_on_model_work():
    engine = _engine(FakeBackend(n_ctx=4096, n_batch=64, step_time=0.05))  # slow steps
    try:
        stream = engine.submit(_request([1] * 10, 8))
        gaps = []
        last = time.monotonic()
        consumer = asyncio.ensure_future(_collect(stream))
        while not consumer.done():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        assert max(gaps) < 0.045  # the loop kept ticking while 50 ms steps ran
    finally:
        engine.shutdown()


async def test_embed_runs_on_the_engine_thread():
    engine = _engine()
    try:
        vectors = await engine.embed([[1, 2, 3], [4, 5]])
        assert len(vectors) == 2 and all(abs(sum(x * x for x in v) - 1) < 1e-6 for v in vectors)
        with pytest.raises(InvalidRequestError):
            await engine.embed([[]])
    finally:
        engine.shutdown()
    with pytest.raises(OverloadedError):
        await engine.embed([[1]])


async def test_stop_strings_and_logprobs_in_events():
    engine = _engine()
    try:
        events, tokens = await _collect(engine.submit(_request([8, 5, 12], 12, sampling=SamplingParams(temperature=0, logprobs=2))))
        text = "".join(e.text for e in events)
        assert all(e.logprobs for e in events if e.token_ids)
        stop = text[2:5]
        events, _ = await _collect(engine.submit(_request([8, 5, 12], 12, stop=[stop])))
        out = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop" and out == text[: text.index(stop)]
    finally:
        engine.shutdown()


async def test_prefix_cache_stats_and_cached_tokens():
    engine = _engine()
    try:
        system = list(range(1, 60))
        await _collect(engine.submit(_request(system + [1], 4)))
        events, _ = await _collect(engine.submit(_request(system + [2, 3], 4)))
        assert events[-1].usage.cached_tokens == 59
        stats = engine.stats()
        assert stats.prefix_cache_hits == 59 and stats.prefix_cache_queries == 60 + 61
        assert 0 < stats.prefix_cache_hit_rate < 1 and stats.parked >= 1
    finally:
        engine.shutdown()


def test_shutdown_before_start_finishes_submitted_streams():
    async def main():
        engine = Engine(FakeBackend(), EngineLimits(max_sequences=2, batch_tokens=64, n_ctx=1024, n_ctx_seq=1024))
        stream = engine.submit(_request([1, 2]))
        engine.shutdown()
        events, _ = await _collect(stream)
        assert events[-1].finish_reason == "cancelled"

    asyncio.run(main())


async def test_an_arrival_stops_a_prompt_step_only_if_its_prompt_is_read_first():
    """Engine.submit's side of StepPlan.yields_to: a step of prompt rows alone stops for a prompt
    that prompt order reads first (a better lane, or due earlier), a batch-only step for any better
    lane, and a batch arrival stops nothing."""
    from localserve.batching.step_plan import StepPlan

    backend = FakeBackend(n_ctx=8192, n_batch=64, n_seq_max=16, interruptible=True)
    engine = Engine(backend, EngineLimits(max_sequences=4, batch_tokens=64, n_ctx=8192, n_ctx_seq=8192), name="fake")

    def stops(prompt_len: int, lane: str = "default") -> bool:
        backend.interrupted = False
        engine.submit(_request([5] * prompt_len, 4, lane=lane))
        return backend.interrupted

    # Not started: the step in flight is set as the engine thread sets it, a default-lane prompt
    # due at step 40 (at step 0 a prompt of n tokens is due at 4 x its 64-row steps).
    engine._in_flight = StepPlan(interruptible=True, yields_to=(1, 40))
    assert stops(100)  # due at 8
    assert not stops(1000)  # due at 64: it would be read after, and the chunk would be redone for nothing
    assert stops(1000, "interactive") and not stops(10, "batch")
    engine._in_flight = StepPlan(interruptible=True)  # batch work alone
    assert stops(1000) and not stops(10, "batch")
