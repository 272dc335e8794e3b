"""ModelManager: which models are loaded, for how long, and which one leaves when memory runs out.

- Load on first use, in a worker thread (loading a GGUF takes seconds; the event loop keeps serving
  /health and the other models meanwhile). Concurrent first requests for one model share one load
  task: two loads of one model would double its memory and race for the budget.
- `use()` pins the model for the duration of a request; a pinned model is never unloaded, neither
  by keep-alive nor by eviction. When the last pin goes, the model expires after its keep-alive
  (settings.keep_alive, or the request's `keep_alive`: 0 = unload right away, negative = never).
- At most settings.max_loaded_models loaded at once and their estimated memory within the budget
  from the hardware report; to make room, the least recently used unpinned model is unloaded first.
  When every loaded model is busy the request gets OverloadedError (503 + Retry-After), not a wait
  of unknown length.

Context size per model (EngineLimits.from_settings decides; see batching/limits.py): every request
gets settings.context_length, or min(trained context, 8192). Where a share of the RAM the weights
leave over holds a KV stream of that length for every sequence id (running and parked prefix-cache
ones), each id gets one (exact answers); otherwise one shared q8_0 pool of up to max_sequences x
context cells serves them all (settings.kv_layout, kv_cache_type). The memory charged to the
budget is the estimate for the whole KV cache plus weights and compute buffers
(memory.estimate_memory); the device and GPU layer count come from placement.choose_backend over
the hardware report.

All state lives on the event loop thread; only loading and unloading run in threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from ..config.aliases import SETTING as ALIAS_SETTING, alias_target
from ..config.settings import Settings
from ..errors import BackendError, InvalidNameError, LocalserveError, ModelNotFoundError, OverloadedError
from ..protocol.engine import ModelEngine
from ..store.cache import InstalledModel, ModelStore
from ..engine.upstream.pool import UpstreamPool

if TYPE_CHECKING:  # the engine pulls in llama.cpp; the manager itself must import without it
    from ..batching.limits import EngineLimits
    from ..engine.local import Engine
    from ..store.gguf_facts import GGUFFacts
    from .memory import MemoryEstimate

log = logging.getLogger(__name__)

# Any ModelEngine will do: the manager only generates, embeds, reads stats and shuts down.
Loader = Callable[[InstalledModel, Settings], ModelEngine]
UNLOAD_TIMEOUT = 10.0  # seconds an engine gets to stop its step loop and free its memory
BUSY_RETRY_AFTER = 2.0  # Retry-After when every loaded model has requests in flight
BUDGET_FRACTION = 0.9  # of available RAM / total VRAM: leave room for the OS and the daemon itself


@dataclass
class ModelPlan:
    """How a model will be loaded: engine limits (context, sequences, batch), device, memory cost."""

    limits: "EngineLimits"
    memory_bytes: int
    n_gpu_layers: int = 0
    device: str = "cpu"
    vram_bytes: int = 0  # the part of memory_bytes expected on the GPU
    choice: Any = None  # placement.BackendChoice: which backend the registry loads it with, and why


@functools.lru_cache(maxsize=1)
def hardware_report() -> Any:
    """Probed once per process: probes spawn tools like nvidia-smi, too slow to repeat per load."""
    from ..hardware import detect_hardware

    return detect_hardware()


def plan_model(installed: InstalledModel, settings: Settings) -> ModelPlan:
    """Limits, memory and backend for a load, over every format the tag holds (backends.registry
    chooses). Sizes come from the GGUF's facts; a tag with only folder variants is charged its
    files' size, since its KV layout is the (future) ONNX backend's to say."""
    from . import registry
    from ..batching.limits import EngineLimits
    from ..store.gguf_facts import GGUFFacts, read_gguf_facts

    estimate = None
    if installed.gguf is not None:
        try:
            facts = GGUFFacts.from_dict(installed.facts) if installed.facts else read_gguf_facts(installed.gguf.path)
        except LocalserveError:
            facts = read_gguf_facts(installed.gguf.path)  # an older manifest without every fact: read the file
        limits, estimate = gguf_limits(facts, settings)
        memory = estimate.total_bytes
    else:
        folder = next(iter(installed.variants.values()))
        limits = EngineLimits.from_settings(settings, n_ctx_train=int(folder.meta.get("context_length") or 0),
                                            model_bytes=folder.size)
        memory = folder.size
    choice = registry.choose(installed, settings, hardware_report(), estimate)
    vram = planned_vram(choice.n_gpu_layers, estimate, memory)
    return ModelPlan(
        limits=limits,
        memory_bytes=memory,
        n_gpu_layers=choice.n_gpu_layers,
        device=choice.device,
        vram_bytes=vram,
        choice=choice,
    )


def planned_vram(n_gpu_layers: int, estimate: "MemoryEstimate | None", memory: int) -> int:
    """The part of `memory` a load with `n_gpu_layers` (-1: all) is expected to put on the GPU."""
    if n_gpu_layers == 0:
        return 0
    if estimate is None or n_gpu_layers < 0 or not estimate.n_layers:
        return memory
    return min(memory, n_gpu_layers * estimate.layer_bytes)


def gguf_limits(facts: "GGUFFacts", settings: Settings) -> tuple["EngineLimits", "MemoryEstimate"]:
    """The engine limits a load of this GGUF gets here and their memory (what `show` prints too)."""
    from ..batching.limits import EngineLimits
    from .memory import KV_BYTES, estimate_memory, kv_cache_bytes

    limits = EngineLimits.from_settings(settings, n_ctx_train=facts.context_length, model_bytes=facts.weights_bytes,
                                        kv_bytes_per_token=kv_cache_bytes(facts, 1))
    streams = 1 if limits.kv_unified else limits.n_seq_max
    estimate = estimate_memory(facts, limits.n_ctx // streams, KV_BYTES[limits.kv_type], n_seq=streams,
                               flash_attention=limits.flash_attention)
    return limits, estimate


def load_engine(installed: InstalledModel, settings: Settings) -> "Engine":
    """The default loader: plan, then the backend the plan chose (backends/registry.py), started."""
    from . import registry

    if not installed.available:
        raise BackendError(f"the files of model {installed.ref} are missing; pull or add it again")
    return registry.load(installed, plan_model(installed, settings), settings)


def memory_budget(settings: Settings) -> int:
    """Bytes the loaded models may use together, from the hardware report: RAM available when the
    daemon starts (nothing is loaded yet then) plus the free VRAM of the GPU llama.cpp offloads to,
    less a safety share. Models larger than the budget still load when they are alone (llama.cpp
    maps weights from disk), they just never share."""
    import psutil

    report = hardware_report()
    ram = report.ram_available_bytes or psutil.virtual_memory().available
    vram = 0
    if report.llama_gpu_offload:
        vram = max((g.vram_free_bytes or g.vram_bytes or 0 for g in report.gpus), default=0)
    return int((ram + vram) * BUDGET_FRACTION)


def _offload_row(engine: ModelEngine) -> dict[str, int]:
    """Where the engine says the load went (vram_bytes beside it is our estimate from the plan)."""
    info = engine.info
    return {"gpu_layers": info.gpu_layers, "offloadable_layers": info.offloadable_layers,
            "gpu_memory_bytes": info.gpu_memory_bytes}


@dataclass
class LoadedModel:
    name: str  # "name:tag"
    engine: ModelEngine
    info: InstalledModel | None  # None for a remote model (served by upstreams, nothing loaded here)
    loaded_at: float  # epoch seconds
    memory_bytes: int
    device: str = "cpu"
    vram_bytes: int = 0
    expires_at: float | None = None  # epoch seconds; None while pinned or when kept forever
    keep_alive: float = 300.0
    pinned: int = 0
    last_used: float = field(default_factory=time.monotonic)
    unload_when_idle: bool = False


class ModelManager:
    def __init__(self, settings: Settings, *, loader: Loader | None = None, budget_bytes: int | None = None):
        self.settings = settings
        self._loader = loader or load_engine
        self._store = ModelStore(settings)
        self._budget = budget_bytes
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._reserved: dict[str, int] = {}  # bytes of models being loaded
        self._unloading: dict[str, tuple[asyncio.Task[None], int]] = {}
        self._capacity = asyncio.Lock()
        self._wake = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        # Remote models: names the store does not hold resolve to upstreams (upstream/), if any.
        self.upstreams = UpstreamPool(settings) if settings.upstreams else None

    @property
    def budget_bytes(self) -> int:
        if self._budget is None:
            self._budget = memory_budget(self.settings)
        return self._budget

    # --- public API ------------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, model_ref: str, keep_alive: float | None = None) -> AsyncIterator[LoadedModel]:
        """The loaded model for `model_ref`, loading it if needed; pinned while inside. A name the
        store does not hold (or refuses as a local name, like an upstream's "org/model" id) may be a
        remote model: then its upstream engine, with nothing to load, pin or unload."""
        served = await self._served(model_ref)
        if not isinstance(served, InstalledModel):
            name, remote = served
            yield LoadedModel(name=name, engine=remote, info=None, loaded_at=time.time(), memory_bytes=0,
                              device="remote")
            return
        model = await self._acquire(served)
        try:
            yield model
        finally:
            self._release(model, keep_alive)

    def status(self) -> list[dict[str, Any]]:
        now = time.time()
        rows = []
        for m in sorted(self._loaded.values(), key=lambda m: m.loaded_at):
            try:
                stats = m.engine.stats().to_dict()
            except Exception:  # a dying engine must not break /api/ps
                log.exception("stats of %s failed", m.name)
                stats = {}
            rows.append(
                {
                    "name": m.name,
                    "state": "loaded",
                    "size": m.info.size,
                    "memory_bytes": m.memory_bytes,
                    "vram_bytes": m.vram_bytes,
                    "device": m.device,
                    "quant": m.info.quant,
                    "format": m.info.format,
                    "sha256": m.info.sha256,
                    "loaded_at": m.loaded_at,
                    "expires_at": m.expires_at,
                    "expires_in": None if m.expires_at is None else max(0.0, m.expires_at - now),
                    "keep_alive": m.keep_alive,
                    "pinned": m.pinned,
                    "running": stats.get("running", 0),
                    "waiting": stats.get("waiting", {}),
                    # What the engine was sized to: tokens per request and requests decoding at once.
                    "context_length": m.engine.n_ctx_per_seq,
                    "max_sequences": stats.get("max_sequences", 0),
                    **_offload_row(m.engine),
                    "stats": stats,
                }
            )
        for name in sorted(self._loading):
            rows.append({"name": name, "state": "loading", "memory_bytes": self._reserved.get(name, 0), "pinned": 0})
        if self.upstreams is not None:
            rows.extend(self.upstreams.model_rows())
        return rows

    async def unload(self, model_ref: str) -> bool:
        """Unload now, or as soon as its requests finish when it is busy. False if not loaded."""
        key = await self._key_of(model_ref)
        model = self._loaded.get(key) if key else None
        if model is None:
            return False
        if model.pinned:
            model.unload_when_idle = True
            return True
        await self._unload(model)
        return True

    async def close(self) -> None:
        """Stop everything: in-flight requests are cancelled by their engines' shutdown."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        # A load running in a thread cannot be interrupted; wait for it so its engine is shut down too.
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        await asyncio.gather(*(self._unload(m) for m in list(self._loaded.values())), return_exceptions=True)
        await asyncio.gather(*(t for t, _ in list(self._unloading.values())), return_exceptions=True)

    # --- acquire / release -----------------------------------------------------------------
    async def _acquire(self, installed: InstalledModel) -> LoadedModel:
        key = installed.ref
        while True:
            if self._closed:
                raise OverloadedError("the server is shutting down", retry_after=BUSY_RETRY_AFTER)
            self._ensure_reaper()
            model = self._loaded.get(key)
            if model is not None:
                model.pinned += 1
                model.expires_at = None
                model.last_used = time.monotonic()
                return model
            task = self._loading.get(key)
            if task is None:
                task = asyncio.create_task(self._load(key, installed), name=f"load {key}")
                self._loading[key] = task
                task.add_done_callback(lambda t, key=key: self._loading.pop(key, None))
            # shield: a client that disconnects while the model loads must not abort the load that
            # other requests are waiting for.
            await asyncio.shield(task)
            # Loop to pin: the model is in _loaded now (or was unloaded in between; then load again).

    def _release(self, model: LoadedModel, keep_alive: float | None) -> None:
        model.pinned -= 1
        model.last_used = time.monotonic()
        model.keep_alive = self.settings.keep_alive if keep_alive is None else keep_alive
        if model.pinned > 0:
            return
        if model.keep_alive == 0 or model.unload_when_idle:
            model.expires_at = time.time()
        elif model.keep_alive < 0:
            model.expires_at = None  # forever
        else:
            model.expires_at = time.time() + model.keep_alive
        self._wake.set()

    # --- load / unload ---------------------------------------------------------------------
    async def _load(self, key: str, installed: InstalledModel) -> LoadedModel:
        async with self._capacity:
            pending = self._unloading.get(key)
            if pending is not None:  # its previous instance is still freeing memory
                await asyncio.gather(pending[0], return_exceptions=True)
            try:
                plan = await asyncio.to_thread(plan_model, installed, self.settings)
            except LocalserveError:
                raise
            except Exception:
                log.exception("planning %s failed", key)
                raise BackendError(f"model {key} cannot be loaded") from None
            if self._budget is None:
                self._budget = await asyncio.to_thread(memory_budget, self.settings)
            await self._make_room(key, plan.memory_bytes)
            self._reserved[key] = plan.memory_bytes
        try:
            started = time.monotonic()
            engine = await asyncio.to_thread(self._loader, installed, self.settings)
        except LocalserveError:
            log.warning("loading %s failed", key, exc_info=True)
            raise
        except Exception:
            # The details (paths, llama.cpp messages) go to the log only.
            log.exception("loading %s failed", key)
            raise BackendError(f"model {key} failed to load") from None
        finally:
            self._reserved.pop(key, None)
        log.info("loaded %s in %.1fs (estimated %d MiB)", key, time.monotonic() - started, plan.memory_bytes >> 20)
        model = LoadedModel(
            name=key,
            engine=engine,
            info=installed,
            loaded_at=time.time(),
            memory_bytes=plan.memory_bytes,
            device=plan.device,
            vram_bytes=plan.vram_bytes,
            keep_alive=self.settings.keep_alive,
            expires_at=time.time() + self.settings.keep_alive,
        )
        if self._closed:
            await self._shutdown_engine(model)
            raise OverloadedError("the server is shutting down", retry_after=BUSY_RETRY_AFTER)
        self._loaded[key] = model
        self._wake.set()
        return model

    async def _make_room(self, key: str, needed: int) -> None:
        """Unload least recently used idle models until one more model of `needed` bytes fits."""
        limit = max(1, self.settings.max_loaded_models)
        while True:
            count = len(self._loaded) + len(self._reserved)
            used = sum(m.memory_bytes for m in self._loaded.values()) + sum(self._reserved.values())
            used += sum(b for _, b in self._unloading.values())
            if count < limit and (used + needed <= self.budget_bytes or count == 0):
                if used + needed > self.budget_bytes:
                    log.warning("%s needs ~%d MiB, more than the %d MiB budget; loading it alone",
                                key, needed >> 20, self.budget_bytes >> 20)
                return
            idle = sorted((m for m in self._loaded.values() if m.pinned == 0), key=lambda m: m.last_used)
            if not idle:
                if self._unloading:
                    await asyncio.gather(*(t for t, _ in list(self._unloading.values())), return_exceptions=True)
                    continue
                busy = ", ".join(sorted([*self._loaded, *self._reserved]))
                raise OverloadedError(
                    f"cannot load {key}: every loaded model is busy ({busy}); try again shortly",
                    retry_after=BUSY_RETRY_AFTER,
                )
            log.info("unloading %s to make room for %s", idle[0].name, key)
            await self._unload(idle[0])

    async def _unload(self, model: LoadedModel) -> None:
        if self._loaded.get(model.name) is not model:
            return
        del self._loaded[model.name]
        task = asyncio.create_task(self._shutdown_engine(model), name=f"unload {model.name}")
        self._unloading[model.name] = (task, model.memory_bytes)
        # Cleared by the task itself, not by whoever awaits it: a waiter may be cancelled, and a
        # leftover entry would count freed memory as used forever.
        task.add_done_callback(lambda t, name=model.name: self._forget_unload(name, t))
        await asyncio.shield(task)

    def _forget_unload(self, name: str, task: asyncio.Task[None]) -> None:
        if self._unloading.get(name, (None, 0))[0] is task:
            del self._unloading[name]

    async def _shutdown_engine(self, model: LoadedModel) -> None:
        try:
            await asyncio.to_thread(model.engine.shutdown, UNLOAD_TIMEOUT)
            log.info("unloaded %s", model.name)
        except Exception:
            log.exception("unloading %s failed", model.name)

    # --- keep-alive ------------------------------------------------------------------------
    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="keep-alive reaper")

    async def _reap(self) -> None:
        while not self._closed:
            self._wake.clear()
            now = time.time()
            next_expiry: float | None = None
            for model in list(self._loaded.values()):
                if model.pinned or model.expires_at is None:
                    continue
                if model.expires_at <= now:
                    log.info("keep-alive of %s expired", model.name)
                    task = asyncio.create_task(self._unload(model))
                    # The loop only keeps weak references to tasks: hold it until it is done.
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                elif next_expiry is None or model.expires_at < next_expiry:
                    next_expiry = model.expires_at
            timeout = None if next_expiry is None else max(0.01, next_expiry - now)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # --- helpers ---------------------------------------------------------------------------
    async def _served(self, model_ref: str) -> "InstalledModel | tuple[str, ModelEngine]":
        """What serves a name: the installed model, or (name, engine) of an upstream's; the name
        itself first, then the model its `model_aliases` item maps it to (config/aliases.py)."""
        try:
            return await self._lookup(model_ref)
        except (ModelNotFoundError, InvalidNameError) as missing:
            target = alias_target(model_ref, self.settings.model_aliases)
            if target is not None:
                return await self._lookup(target)
            if not isinstance(missing, ModelNotFoundError):
                raise
            # Agents send names of models that are not ours (claude-*, gpt-*): say how to serve them.
            raise ModelNotFoundError(
                model_ref, missing.suggestions,
                message=f"model {model_ref!r} is not served here: pull it, or map the name to an installed "
                        f"model with the {ALIAS_SETTING} setting (e.g. {model_ref.split('-')[0]}-*={self.settings.default_model})",
            ) from None

    async def _lookup(self, model_ref: str) -> "InstalledModel | tuple[str, ModelEngine]":
        try:
            return await asyncio.to_thread(self._store.find, model_ref)
        except (ModelNotFoundError, InvalidNameError):
            remote = await self.upstreams.engine_for(model_ref) if self.upstreams is not None else None
            if remote is None:
                raise
            return model_ref, remote

    async def _key_of(self, model_ref: str) -> str | None:
        """The loaded model a reference names: exact `name:tag`, or what the store resolves it to,
        or a name with exactly one loaded tag (its manifest may be gone: `rm` of a loaded model)."""
        if model_ref in self._loaded:
            return model_ref
        try:
            return (await asyncio.to_thread(self._store.find, model_ref)).ref
        except LocalserveError:
            matches = [k for k in self._loaded if k.split(":")[0].lower() == model_ref.lower()]
            return matches[0] if len(matches) == 1 else None
