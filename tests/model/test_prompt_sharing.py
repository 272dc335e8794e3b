"""Prompts that share a lane on the real SmolLM2 (issue 48): a short prompt arriving behind a long
one is read first and answers before the long prompt is read, a long prompt is not starved by a
stream of short ones, and the queue timeout fails a request whose lane is stuck, never one that
waits while the requests ahead of it make progress."""

from __future__ import annotations

import asyncio
import time

import pytest

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.batching.limits import EngineLimits
from localserve.engine.local import Engine
from localserve.protocol.requests import GenerationRequest, SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0)
BUDGET = 48  # below 64 rows a step's rounding is the same whatever shares it (test_engine_llamacpp.py)


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    b = LlamaCppBackend.load(smollm2_gguf, n_ctx=8192, n_seq_max=4, n_batch=256, n_threads=1,
                             kv_unified=False, flash_attention=False)
    yield b
    b.close()


def engine_for(backend: LlamaCppBackend, **limits) -> Engine:
    defaults = dict(max_sequences=4, batch_tokens=BUDGET, n_ctx=backend.n_ctx, n_ctx_seq=2048, prefix_cache=False)
    backend.kv_clear()
    engine = Engine(backend, EngineLimits(**(defaults | limits)), name="smollm2")
    engine.start()
    return engine


def text_of(backend: LlamaCppBackend, topic: str, sentences: int) -> list[int]:
    filler = " ".join([f"Some notes about {topic} and the many details it has."] * sentences)
    return backend.tokenize(f"<|im_start|>user\n{filler} Write about {topic}.<|im_end|>\n<|im_start|>assistant\n")


async def answer(engine: Engine, prompt: list[int], max_tokens: int, lane: str = "default",
                 first: list[float] | None = None) -> tuple[list[int], object]:
    """The answer's tokens and its last event; `first` gets the time of its first token."""
    tokens, last = [], None
    async for event in engine.submit(GenerationRequest(prompt, GREEDY, max_tokens=max_tokens, lane=lane,
                                                       ignore_eos=True)):
        if event.token_ids and first is not None and not first:
            first.append(time.monotonic())
        tokens += event.token_ids
        last = event
    return tokens, last


def sequence_of(engine: Engine, n_prompt: int):
    return next(s for s in engine.in_flight().values() if s.num_prompt == n_prompt)


async def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.005)


async def test_a_short_prompt_behind_a_long_one_answers_before_the_long_prompt_is_read(backend):
    long_prompt, short_prompt = text_of(backend, "rivers", 120), text_of(backend, "tea", 4)
    assert len(long_prompt) > 1200 and len(short_prompt) < 100
    engine = engine_for(backend)
    try:
        alone, _ = await answer(engine, short_prompt, 8)
        long_task = asyncio.create_task(answer(engine, long_prompt, 4))
        await until(lambda: any(s.num_computed > 0 for s in engine.in_flight().values()))
        long_seq = sequence_of(engine, len(long_prompt))
        first: list[float] = []
        short, last = await answer(engine, short_prompt, 8, first=first)
        # The long prompt was still being read when the short one answered in full.
        assert long_seq.num_computed < len(long_prompt) and not long_seq.num_generated
        assert short == alone and last.usage.ttft_s > 0
        long, _ = await long_task
        assert len(long) == 4
    finally:
        engine.shutdown()


async def test_a_long_prompt_is_read_under_a_stream_of_short_ones(backend):
    long_prompt = text_of(backend, "winter", 12)  # ~170 tokens: 4 steps alone
    # A short aging period: the long prompt is due after 16 steps of waiting rather than 256, and the
    # rule proved is the same (the default's 256 steps of short prompts took 109 s of CI's time).
    engine = engine_for(backend, aging_steps=16)
    try:
        long_task = asyncio.create_task(answer(engine, long_prompt, 2))
        shorts = []
        step0 = engine.scheduler.step
        while not long_task.done():
            # Always two short prompts waiting or being read: each is due before the long one
            # until the long one is late.
            if sum(not t.done() for t in shorts) < 2:
                shorts.append(asyncio.create_task(answer(engine, text_of(backend, f"tea {len(shorts)}", 2), 1)))
            await asyncio.sleep(0.002)
            assert engine.scheduler.step - step0 < 200, "the long prompt starved"
        assert sum(t.done() for t in shorts) >= 2  # short ones did go first meanwhile
        await asyncio.gather(*shorts)
    finally:
        engine.shutdown()


async def test_the_queue_timeout_fails_a_stuck_lane_not_a_busy_one(backend):
    timeout = 1.0
    engine = engine_for(backend, max_sequences=1, queue_timeout=timeout, aging_steps=1_000_000)
    try:
        running = asyncio.create_task(answer(engine, text_of(backend, "cats", 2), 1500))
        await until(lambda: engine.scheduler.running)
        behind = asyncio.create_task(answer(engine, text_of(backend, "bread", 2), 4))  # its lane decodes
        stuck = asyncio.create_task(answer(engine, text_of(backend, "moons", 2), 4, lane="batch"))  # no slot
        _, last = await asyncio.wait_for(stuck, 30)
        assert last.finish_reason == "error" and "no progress" in last.error.message
        assert last.error.http_status == 503
        # The default-lane request has waited as long, and is still waiting: its lane is busy.
        assert not behind.done() and not running.done()
        seq = next(s for s in engine.in_flight().values() if s.request.lane == "default" and s.queued)
        assert time.monotonic() - seq.t_submit > timeout
        row = engine.live_sequences()[seq.request_id]
        assert row.state == "waiting" and row.stalled_s < timeout  # what the dashboard shows
        engine.cancel(next(s.request_id for s in engine.in_flight().values() if not s.queued))
        tokens, last = await asyncio.wait_for(behind, 60)
        assert last.finish_reason == "length" and len(tokens) == 4
        await running
    finally:
        engine.shutdown()
