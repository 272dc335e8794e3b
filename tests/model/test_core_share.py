"""Our engines share the cores (engine/core_share.py): a step never computes on threads another
engine's running step holds. The record is the real shared memory and lock that cross to engine
workers; the processes that die holding a slot or the lock are real processes; and two real engines
of SmolLM2 decode at once on this machine's cores."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
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
    share._lock.acquire()  # the semaphore itself, as a process killed inside join() leaves it
    ready.set()
    os._exit(0)


def _freeze_inside_a_step(share: CoreShare, ready, moved, release) -> None:
    """Takes both threads and stops (SIGSTOP, as a native hang would hold them); once continued,
    ends that step and takes again (it moved), then holds them until `release`."""
    seat = share.join()
    seat.take(2, 2)
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    seat.step_done()
    seat.take(2, 2)
    moved.set()
    release.wait(30)
    seat.step_done()  # and has work still, until the test ends it
    time.sleep(60)


class _StopHere:
    """Stands in for core_share's fence: the process stops between a claim's write and its check."""

    def __enter__(self) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        pass


def _freeze_inside_a_claim(share: CoreShare, ready) -> None:
    seat = share.join()
    core_share._FENCE = _StopHere()
    ready.set()
    seat.take(2, 2)


ROUNDS, PAUSE_S = 500, 0.0005


def _race(share: CoreShare, ready, go, rounds: int, over, done) -> None:
    seat = share.join()
    clock = core_share._now_ms
    # The clock is read between a take's first look and its claim: a pause there makes the look
    # stale by the time it claims (the other engine went idle, or claimed), which the claim's
    # check must catch. With the check removed, a quarter to a third of the rounds held 3 threads.
    core_share._now_ms = lambda: (time.sleep(PAUSE_S), clock())[1]
    ready.set()
    go.wait(30)
    for _ in range(rounds):
        seat.take(2, 2)
        time.sleep(PAUSE_S)  # a step
        if share.threads_in_use() > 2:
            with over.get_lock():
                over.value += 1
        seat.step_done()
        seat.idle()
        time.sleep(PAUSE_S)  # idle: the other engine may claim the whole machine
    with done.get_lock():
        done.value += 1


_FORK = multiprocessing.get_context("fork")  # the share travels by inheritance, as into a worker


def _start(target, share: CoreShare, *args) -> tuple[multiprocessing.Process, object]:
    ready = _FORK.Event()
    process = _FORK.Process(target=target, args=(share, ready, *args), daemon=True)
    process.start()
    assert ready.wait(30)
    return process, ready


def _child(target, share: CoreShare) -> int:
    process, _ = _start(target, share)
    process.join(30)
    return process.pid


def _takes(seat: Seat, n: int) -> list[int]:
    got = []
    for _ in range(n):
        got.append(seat.take(2, 2))
        seat.step_done()
    return got


def _slot_of(share: CoreShare, pid: int) -> int:
    return next(slot for slot in range(core_share.SLOTS) if share._cells[slot * core_share._FIELDS] == pid)


def test_a_worker_that_died_inside_a_step_is_not_waited_for_and_is_forgotten():
    share = CoreShare()
    seat = share.join()
    pid = _child(_die_holding_threads, share)
    assert share.threads_in_use() == 2  # the dead worker's slot still says it holds both cores...
    assert _takes(seat, 3) == [2, 2, 2]  # ...and nobody waits for a process that is gone
    assert seat.waits == 0 and list(seat.stalled) == [_slot_of(share, pid)]
    share.forget(pid)  # the daemon reads its exit (engine/worker/proxy.py): the slot is free
    assert share.threads_in_use() == 0
    assert _takes(seat, 1) == [2] and seat.stalled == {}
    assert share.join() is not None


def test_an_engine_frozen_inside_a_step_costs_the_others_one_wait_once():
    share = CoreShare()
    seat = share.join()
    moved, release = _FORK.Event(), _FORK.Event()
    process, _ = _start(_freeze_inside_a_step, share, moved, release)
    try:
        frozen = _slot_of(share, process.pid)
        t0 = time.monotonic()
        assert _takes(seat, 21) == [2] * 21  # the frozen step's threads no longer count...
        assert time.monotonic() - t0 < core_share.WAIT_LIMIT_S + 2  # (a hang guard only)
        assert seat.waits == 1  # ...after one wait, by the first take only
        assert seat.stalled == {frozen: (process.pid, 1)}
        # It moves again: its next step counts, and this engine waits for it as for any other.
        seat.idle()
        os.kill(process.pid, signal.SIGCONT)
        assert moved.wait(30)
        thread, got = _take_in_thread(seat, 2, 2)
        thread.join(0.2)
        assert thread.is_alive() and seat.stalled == {}, (got, seat.stalled)
        release.set()
        thread.join(5)
        assert got == [1] and seat.waits == 2  # it still has work: half each
    finally:
        process.kill()
        process.join(30)


def test_an_engine_frozen_inside_its_claim_costs_one_short_wait():
    """Stopped between writing a claim and checking it (the take's two writes): the claim is
    pending for ever, and counts only until it is older than a claim ever is."""
    share = CoreShare()
    seat = share.join()
    process, _ = _start(_freeze_inside_a_claim, share)
    try:
        frozen = _slot_of(share, process.pid)
        deadline = time.monotonic() + 30
        while not share._cells[frozen * core_share._FIELDS + core_share._CLAIM]:  # it reached the fence
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert _takes(seat, 21) == [2] * 21
        assert seat.waits == 1 and list(seat.stalled) == [frozen]
        assert share.threads_in_use() == 0  # a claim is not a step: nothing to undo
    finally:
        process.kill()
        process.join(30)


def test_a_lock_left_by_a_dead_process_costs_one_timeout_and_no_take():
    share = CoreShare()
    seat = share.join()
    _child(_die_holding_the_lock, share)
    assert _takes(seat, 20) == [2] * 20 and seat.waits == 0  # a take never takes the lock
    assert share.join() is not None  # after one LOCK_TIMEOUT_S, released for the dead process
    assert share._lock.acquire(timeout=0)  # and free again: later joins do not wait
    share._lock.release()
    assert share.join() is not None


def test_engines_claiming_at_once_never_compute_on_more_threads_than_the_limit():
    """Two processes take, end and idle ROUNDS times each, each take racing the other's for the whole
    machine: without a lock, never more than 2 threads are held by running steps."""
    share = CoreShare()
    go, over, done = _FORK.Event(), _FORK.Value("i", 0), _FORK.Value("i", 0)
    processes = [_start(_race, share, go, ROUNDS, over, done)[0] for _ in range(2)]
    go.set()
    for process in processes:
        process.join(120)
    assert done.value == 2 and over.value == 0, (done.value, over.value)
    assert share.threads_in_use() == 0


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
