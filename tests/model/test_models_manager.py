"""ModelManager on the real SmolLM2-135M: load once under concurrent first use, keep-alive, LRU
eviction by count and by memory budget, never evicting a busy model, safe load errors, shutdown."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.config.settings import Settings, load_settings
from localserve.errors import BackendError, GGUFError, ModelNotFoundError, OverloadedError
from localserve.runtime.manager import ModelManager
from localserve.runtime.planning import load_engine, plan_model
from localserve.store.cache import ModelStore

pytestmark = pytest.mark.model


def make_settings(home: Path, **flags: object) -> Settings:
    base = {"home": str(home), "threads": 2, "context_length": 512, "max_sequences": 4}
    return load_settings(flags={**base, **flags}, environ={}, config_path=home / "no-config.toml")


@pytest.fixture
def home(tmp_path: Path, smollm2_gguf: Path) -> Path:
    """A fresh home with the real model registered under three names (same file, in place)."""
    settings = make_settings(tmp_path)
    store = ModelStore(settings)
    for name in ("alpha", "beta", "gamma"):
        store.register_local(smollm2_gguf, name)
    return tmp_path


@pytest.fixture
async def managers():
    """Builds ModelManagers and closes every one at teardown, so a failing test never leaves an
    engine thread running."""
    made: list[ModelManager] = []

    def make(*args, **kwargs) -> ModelManager:
        made.append(ModelManager(*args, **kwargs))
        return made[-1]

    yield make
    for manager in made:
        await manager.close()


class CountingLoader:
    """The real loader, counting calls (and slowed a little, so concurrent first uses overlap)."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[str] = []
        self.delay = delay
        self.engines: list = []
        self._lock = threading.Lock()

    def __call__(self, installed, settings):
        with self._lock:
            self.calls.append(installed.ref)
        if self.delay:
            threading.Event().wait(self.delay)
        engine = load_engine(installed, settings)
        self.engines.append(engine)
        return engine


async def generate(model, text: str = "Hello, my name is", max_tokens: int = 6) -> str:
    engine = model.engine
    request = GenerationRequest(
        prompt_tokens=engine.tokenize(text), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)
    )
    parts = [event.text async for event in await engine.generate(request)]
    return "".join(parts)


def names(manager: ModelManager) -> list[str]:
    return [row["name"] for row in manager.status() if row["state"] == "loaded"]


async def test_concurrent_first_use_loads_once(managers, home: Path) -> None:
    loader = CountingLoader(delay=0.3)
    manager = ModelManager(make_settings(home), loader=loader)
    seen = []

    async def one() -> str:
        async with manager.use("alpha") as model:
            seen.append(model.engine)
            return await generate(model)

    try:
        answers = await asyncio.gather(*(one() for _ in range(4)))
        assert loader.calls == ["alpha:latest"]
        assert len({id(e) for e in seen}) == 1
        assert len(set(answers)) == 1 and answers[0].strip()  # greedy: the same answer for all
        [row] = manager.status()
        assert row["name"] == "alpha:latest" and row["pinned"] == 0 and row["memory_bytes"] > 0
        assert row["expires_in"] is not None and 290 < row["expires_in"] <= 300
        assert set(row["waiting"]) == {"interactive", "default", "batch"}
    finally:
        await manager.close()
    assert manager.status() == []


async def test_status_while_in_use_shows_pin_and_no_expiry(managers, home: Path) -> None:
    manager = managers(make_settings(home))
    async with manager.use("alpha") as model:
        assert model.name == "alpha:latest" and model.info.name == "alpha"
        [row] = manager.status()
        assert row["pinned"] == 1 and row["expires_at"] is None
        async with manager.use("alpha:latest"):
            assert manager.status()[0]["pinned"] == 2
        assert manager.status()[0]["pinned"] == 1


async def test_keep_alive_expiry_unloads_and_next_use_reloads(managers, home: Path) -> None:
    loader = CountingLoader()
    manager = managers(make_settings(home), loader=loader)
    async with manager.use("alpha", keep_alive=0.5) as model:
        await generate(model)
    assert names(manager) == ["alpha:latest"]
    assert 0 < manager.status()[0]["expires_in"] <= 0.5
    await asyncio.sleep(1.2)
    assert names(manager) == []
    first = loader.engines[0]
    assert not first.alive  # its engine worker process ended
    async with manager.use("alpha") as model:
        await generate(model)
    assert loader.calls == ["alpha:latest", "alpha:latest"]


async def test_keep_alive_zero_unloads_right_after_and_negative_keeps_forever(managers, home: Path) -> None:
    manager = managers(make_settings(home, keep_alive=0.3))
    async with manager.use("alpha", keep_alive=0):
        pass
    await asyncio.sleep(0.2)
    assert names(manager) == []
    async with manager.use("beta", keep_alive=-1):
        pass
    await asyncio.sleep(0.6)  # past the 0.3 s default
    [row] = manager.status()
    assert row["name"] == "beta:latest" and row["expires_at"] is None and row["keep_alive"] < 0


async def test_max_loaded_one_never_evicts_a_busy_model(managers, home: Path) -> None:
    """With room for one, a request for another model waits (no 503) while the busy one serves,
    and gets its model as soon as the busy one is idle (an idle model gives its slot up at once)."""
    loader = CountingLoader()
    manager = managers(make_settings(home, max_loaded_models=1), loader=loader)
    async with manager.use("alpha") as model:
        waiting = asyncio.create_task(_use_once(manager, "beta"))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if any(row["state"] == "waiting" for row in manager.status()):
                break
        row = next(row for row in manager.status() if row["name"] == "beta:latest")
        assert row["state"] == "waiting" and row["waiting"]["default"] == 1
        assert "alpha:latest" in row["reason"] and "minimum residency" in row["reason"]
        assert names(manager) == ["alpha:latest"]
        assert (await generate(model)).strip()  # alpha still serves
        assert not waiting.done()
    await asyncio.wait_for(waiting, 60)  # alpha idle now: beta took its place
    assert names(manager) == ["beta:latest"]
    assert loader.calls == ["alpha:latest", "beta:latest"]


async def test_a_wait_for_a_load_times_out_with_503(managers, home: Path) -> None:
    manager = managers(make_settings(home, max_loaded_models=1, queue_timeout=0.5))
    async with manager.use("alpha"):
        with pytest.raises(OverloadedError) as err:
            await _use_once(manager, "beta")
    assert err.value.http_status == 503 and "waited" in err.value.message and "alpha:latest" in err.value.message
    assert not [row for row in manager.status() if row["state"] == "waiting"]


async def test_lru_order_with_two_slots(managers, home: Path) -> None:
    manager = managers(make_settings(home, max_loaded_models=2))
    for ref in ("alpha", "beta", "alpha"):  # beta is now the least recently used
        async with manager.use(ref):
            pass
    async with manager.use("gamma"):
        pass
    assert sorted(names(manager)) == ["alpha:latest", "gamma:latest"]


async def test_memory_budget_evicts_least_recently_used(managers, home: Path) -> None:
    settings = make_settings(home, max_loaded_models=3)
    one_model = plan_model(ModelStore(settings).find("alpha"), settings).memory_bytes
    manager = managers(settings, budget_bytes=int(one_model * 1.5))  # room for one model only
    async with manager.use("alpha"):
        pass
    async with manager.use("beta"):
        pass
    assert names(manager) == ["beta:latest"]


async def test_unknown_model_is_model_not_found(managers, home: Path) -> None:
    manager = managers(make_settings(home))
    with pytest.raises(ModelNotFoundError):
        async with manager.use("no-such-model"):
            pass
    assert manager.status() == []


async def test_failed_load_gives_safe_backend_error_and_can_retry(managers, home: Path) -> None:
    calls = []

    def flaky(installed, settings):
        calls.append(1)
        if len(calls) == 1:
            threading.Event().wait(0.5)  # slow enough that every concurrent request joins this load
            # What a real failure looks like from deep inside llama.cpp bindings: a host path.
            raise RuntimeError(f"failed to mmap {installed.path}")
        return load_engine(installed, settings)

    manager = managers(make_settings(home), loader=flaky)
    results = await asyncio.gather(*(_use_once(manager, "alpha") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, BackendError) for r in results), results
    assert len(calls) == 1  # the waiters shared the one failed load
    message = str(results[0])
    assert "alpha:latest" in message and "/" not in message and "mmap" not in message
    assert manager.status() == []
    await _use_once(manager, "alpha")  # a later request tries again
    assert len(calls) == 2


async def test_damaged_model_file_is_a_clear_error(managers, home: Path, tmp_path: Path, smollm2_gguf: Path) -> None:
    settings = make_settings(home)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(smollm2_gguf.read_bytes())
    ModelStore(settings).register_local(copy, "damaged")
    with open(copy, "r+b") as f:  # the file changed after registration: truncated to its header
        f.truncate(4096)
    manager = managers(settings)
    with pytest.raises(GGUFError) as err:
        await _use_once(manager, "damaged")
    assert str(tmp_path) not in str(err.value)


async def test_unload_and_close_cancel_in_flight(managers, home: Path) -> None:
    manager = ModelManager(make_settings(home))
    async with manager.use("alpha") as model:
        engine = model.engine
        stream = await engine.generate(
            GenerationRequest(prompt_tokens=engine.tokenize("Tell a long story."), max_tokens=400, ignore_eos=True)
        )
        first = await stream.__anext__()
        assert first.finish_reason is None
        assert await manager.unload("alpha") is True  # busy: unloads when released
        assert names(manager) == ["alpha:latest"]
        close = asyncio.create_task(manager.close())
        events = [event async for event in stream]
        assert events[-1].finish_reason == "cancelled"
    await close
    assert manager.status() == []
    assert await manager.unload("alpha") is False
    with pytest.raises(OverloadedError):
        await _use_once(manager, "alpha")


async def _use_once(manager: ModelManager, ref: str) -> None:
    async with manager.use(ref):
        pass
