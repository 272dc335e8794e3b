"""Our engines share the cores (engine/core_share.py): a step never computes on threads another
engine's running step holds. The record is the real shared memory and lock that cross to engine
workers; the processes that die holding a slot or the lock are real processes; and two real engines
of SmolLM2 decode at once on this machine's cores."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time

import pytest

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.batching.limits import EngineLimits
from localserve.engine import core_share
from localserve.engine.core_share import CoreShare, Seat
from localserve.engine.local import Engine
from localserve.protocol.requests import GenerationRequest, SamplingParams


def _take_in_thread(seat: Seat, want: int, limit: int) -> tuple[threading.Thread, list[int]]:
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(seat.take(want, limit)), daemon=True)
    thread.start()
    return thread, got


def test_an_engine_alone_takes_what_the_governor_wants():
    share = CoreShare()
    seat = share.join()
    assert seat is not None
    assert seat.take(2, 2) == 2 and share.threads_in_use() == 2
    seat.step_done()
    assert share.threads_in_use() == 0
    assert seat.take(1, 2) == 1  # other processes took a core: the governor wants one
    seat.leave()


def test_a_second_engine_waits_for_the_running_step_then_both_take_half():
    share = CoreShare()
    a, b = share.join(), share.join()
    assert a.take(2, 2) == 2  # alone: the whole machine
    thread, got = _take_in_thread(b, 2, 2)
    thread.join(0.2)
    assert thread.is_alive() and not got, "b computed beside a's step, which holds both cores"
    a.step_done()
    thread.join(2)
    assert got == [1]  # a has work too: b's fair share is half
    assert a.take(2, 2) == 1 and share.threads_in_use() == 2
    a.step_done()
    b.step_done()
    b.idle()  # b's requests ended: a gets the machine back at its next step
    assert a.take(2, 2) == 2


def test_a_full_share_leaves_an_engine_unshared():
    share = CoreShare()
    slots = [share.join() for _ in range(core_share.SLOTS)]
    assert None not in slots and share.join() is None


def _die_holding_threads(share: CoreShare, ready) -> None:
    share.join().take(2, 2)
    ready.set()
    os._exit(0)  # as a worker that segfaults inside a step: nothing released


def _die_holding_the_lock(share: CoreShare, ready) -> None:
    share._lock.acquire()
    ready.set()
    os._exit(0)


def _child(target, share: CoreShare) -> int:
    ctx = multiprocessing.get_context("fork")  # the share travels by inheritance, as into a worker
    ready = ctx.Event()
    process = ctx.Process(target=target, args=(share, ready))
    process.start()
    assert ready.wait(30)
    process.join(30)
    return process.pid


def test_a_worker_that_died_inside_a_step_is_forgotten():
    share = CoreShare()
    pid = _child(_die_holding_threads, share)
    assert share.threads_in_use() == 2
    thread, got = _take_in_thread(share.join(), 2, 2)
    thread.join(0.2)
    assert thread.is_alive()  # the dead worker's slot still holds both cores...
    share.forget(pid)  # ...until the daemon reads its exit (engine/worker/proxy.py)
    thread.join(2)
    assert got == [2]


def test_a_lock_left_by_a_dead_process_costs_a_step_its_share_only():
    share = CoreShare()
    _child(_die_holding_the_lock, share)
    seat = Seat(share, 0)  # join() cannot take the lock either
    t = time.monotonic()
    assert seat.take(2, 2) == 2  # as if unshared, after LOCK_TIMEOUT_S
    assert time.monotonic() - t < 1.0


@pytest.mark.model
async def test_two_real_engines_never_compute_on_more_threads_than_the_machine_has(smollm2_gguf, monkeypatch):
    """Two engines (as two models' workers) with 2 threads each, generating at once: at every moment
    the threads of their running decodes add up to 2 at most, and both engines computed."""
    share = CoreShare()
    monkeypatch.setattr(core_share, "_current", share)
    engines, backends = [], []
    for _ in range(2):
        backend = LlamaCppBackend.load(smollm2_gguf, n_ctx=1024, n_seq_max=1, n_batch=128, n_threads=2,
                                       kv_unified=False, flash_attention=False)
        backends.append(backend)
        engine = Engine(backend, EngineLimits(max_sequences=1, batch_tokens=128, n_ctx=1024, n_ctx_seq=1024,
                                              adaptive_threads=True))
        engine.start()
        engines.append(engine)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(share.threads_in_use())
            time.sleep(0.0002)

    async def generate(engine: Engine, prompt: str) -> int:
        request = GenerationRequest(prompt_tokens=engine.tokenize(prompt), max_tokens=48, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0))
        return sum([len(e.token_ids) async for e in engine.submit(request)])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        counts = await asyncio.gather(*(generate(e, f"Tell me about the number {i}. " * 12)
                                        for i, e in enumerate(engines)))
    finally:
        stop.set()
        watcher.join()
        for engine in engines:
            engine.shutdown()
        for backend in backends:
            backend.close()
    assert counts == [48, 48]
    assert max(seen) <= 2, max(seen)
    assert 1 in seen and 2 in seen  # both engines' steps were seen, alone and side by side
    assert share.threads_in_use() == 0
