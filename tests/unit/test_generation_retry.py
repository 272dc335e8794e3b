"""A request that comes in the moment after a model's worker died (api/generation.generation): its
worker had ended before it took the request, so nothing of it ran, and it goes once more to the
model loaded again instead of failing with the crash of an engine it never reached. A crash the
engine reports while it still lives, or a second dead engine, is the client's error as before.

The daemon's side of it runs on real workers in tests/system/test_prompt_cache_daemon.py (a request
right after a SIGKILLed worker); this pins the rule with engines that only submit."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from localserve.api.generation import generation
from localserve.errors import EngineCrashedError
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.runtime.loaded import Lease, LoadedModel


class Engine:
    def __init__(self, alive: bool, crashed: bool):
        self.alive = alive
        self.crashed = crashed
        self.submitted: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest):
        if self.crashed:
            raise EngineCrashedError("the engine for m stopped (SIGKILL) and is being restarted", "SIGKILL")
        self.submitted.append(request)
        return Stream()


class Stream:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Manager:
    """Leases each engine of `engines` in turn, as the manager hands out what is loaded."""

    def __init__(self, *engines: Engine):
        self.engines = list(engines)
        self.leased: list[Engine] = []

    @asynccontextmanager
    async def use(self, model: str, keep_alive=None, lane="default"):
        engine = self.engines.pop(0)
        self.leased.append(engine)
        yield Lease(LoadedModel(name=model, engine=engine, info=None, loaded_at=0.0, memory_bytes=0))


async def prepare(engine) -> list[GenerationRequest]:
    return [GenerationRequest([1, 2, 3], SamplingParams(temperature=0.0), max_tokens=4)]


async def run(manager: Manager) -> Engine:
    async with generation(manager, "m", None, prepare) as run:
        return run.engine


def test_a_request_to_a_worker_that_had_died_goes_to_the_model_loaded_again() -> None:
    dead, fresh = Engine(alive=False, crashed=True), Engine(alive=True, crashed=False)
    manager = Manager(dead, fresh)
    assert asyncio.run(run(manager)) is fresh
    assert manager.leased == [dead, fresh] and len(fresh.submitted) == 1


def test_a_crash_of_a_living_engine_or_a_second_dead_one_is_the_clients_error() -> None:
    with pytest.raises(EngineCrashedError):  # reported by an engine still alive: not retried
        asyncio.run(run(Manager(Engine(alive=True, crashed=True), Engine(alive=True, crashed=False))))
    manager = Manager(Engine(alive=False, crashed=True), Engine(alive=False, crashed=True), Engine(True, False))
    with pytest.raises(EngineCrashedError):  # once more, not in a loop
        asyncio.run(run(manager))
    assert len(manager.leased) == 2
