"""ModelManager: which models are loaded, for how long, and who waits for a load.

- Load on first use, in a worker thread (loading a GGUF takes seconds; the event loop keeps serving
  /health and the other models meanwhile). Concurrent first requests for one model share one load:
  two loads of one model would double its memory and race for the budget.
- `use()` leases the model for the duration of a request (loaded.py); a leased model is never
  unloaded, neither by keep-alive nor by a swap. When the last lease goes, the model expires after
  its keep-alive (keep_alive.py: settings.keep_alive, or the request's `keep_alive`: 0 = unload
  right away, negative = never).
- How many models stay loaded comes from their memory estimates against what the machine has now
  (planning.memory_budget), with settings.max_loaded_models as an upper bound when set. A request
  for a model that does not fit waits in its lane for a swap, under the lane's queue bound and
  timeout (429 + Retry-After when the lane is full, 503 when the wait times out); which loaded model
  makes room and when is the swap policy's to say (swaps.py). Nothing in flight is aborted for a
  swap, except batch-lane work outranked by a better lane, which the Batch API runs again.

All state lives on the event loop thread; only planning, loading and unloading run in threads.
`_tick()` is the one place that hands out leases to waiting requests and starts loads and swaps;
whatever changes the picture (a request arrives or ends, a load or unload finishes, a thrash guard
runs out) calls it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from ..config.settings import Settings
from ..errors import BackendError, EngineCrashedError, LocalserveError, OverloadedError
from ..protocol.engine import ModelEngine
from ..protocol.requests import Lane
from ..store.cache import InstalledModel, ModelStore
from ..engine.upstream.pool import UpstreamPool
from ..engine.worker.proxy import WorkerEngine
from . import swaps
from .crashes import CrashBook
from .keep_alive import KeepAliveReaper
from .resolve import resolve
from .loaded import Lease, LoadedModel
from .status_rows import failed_row, loaded_row, loading_row
from .planning import ModelPlan, load_engine, memory_budget, plan_model

log = logging.getLogger(__name__)

# Any ModelEngine will do: the manager only generates, embeds, reads stats and shuts down.
Loader = Callable[[InstalledModel, Settings], ModelEngine]
UNLOAD_TIMEOUT = 10.0  # seconds an engine gets to stop its step loop and free its memory
BUSY_RETRY_AFTER = 2.0  # Retry-After while shutting down, and after a wait for a load timed out
DEATH_NOTICE_S = 2.0  # the most a request waits for the loop to hear that a model's worker died


class ModelManager:
    def __init__(self, settings: Settings, *, loader: Loader | None = None, budget_bytes: int | None = None):
        self.settings = settings
        self._loader = loader or load_engine
        self._store = ModelStore(settings)
        self._budget = budget_bytes  # fixed by the caller (tests), else asked of the machine each time
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._reserved: dict[str, int] = {}  # bytes of models being loaded
        self._unloading: dict[str, tuple[asyncio.Task[None], int]] = {}
        self._planned: dict[tuple[str, str], ModelPlan] = {}  # (ref, sha256) -> its plan
        self._load_seconds: dict[str, float] = {}  # the last load of each model, for Retry-After
        self._queues = swaps.LoadQueues(settings.queue_size, self._retry_after)
        self._recheck: asyncio.TimerHandle | None = None
        self._reaper = KeepAliveReaper(self._loaded.values, self._begin_unload)
        self._closed = False
        self.crashes = CrashBook()
        # Remote models: names the store does not hold resolve to upstreams (upstream/), if any.
        self.upstreams = UpstreamPool(settings) if settings.upstreams else None

    @property
    def budget_bytes(self) -> int:
        if self._budget is not None:
            return self._budget
        ours = sum(m.memory_bytes - m.vram_bytes for m in self._loaded.values()) + sum(self._reserved.values())
        return memory_budget(self.settings, ours)

    # --- public API ------------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, model_ref: str, keep_alive: float | None = None,
                  lane: Lane = "default", explicit: bool = False) -> AsyncIterator[Lease]:
        """A lease on the loaded model for `model_ref`, loading it if needed (waiting in `lane`
        when it must wait for a swap); held while inside. A name the store does not hold (or
        refuses as a local name, like an upstream's "org/model" id) may be a remote model: then its
        upstream engine, with nothing to load, lease or unload. Names resolve through
        `model_aliases` (resolve.py). `explicit`: the user asked to load this model (not a request
        that needs it), which loads one marked failed after crashes again (crashes.py)."""
        async with self._lease(model_ref, keep_alive, lane, hold=False, explicit=explicit) as lease:
            yield lease

    @asynccontextmanager
    async def hold(self, model_ref: str) -> AsyncIterator[Lease]:
        """Keep a model loaded between a batch's lines without counting as work: a swap may revoke
        the hold (`lease.revoked`), and the holder then takes a new one, after the swap."""
        async with self._lease(model_ref, None, "batch", hold=True) as lease:
            yield lease

    @asynccontextmanager
    async def _lease(self, model_ref: str, keep_alive: float | None, lane: Lane, hold: bool,
                     explicit: bool = False) -> AsyncIterator[Lease]:
        served = await resolve(model_ref, self._store, self.upstreams, self.settings)
        if not isinstance(served, InstalledModel):
            name, remote = served
            yield Lease(LoadedModel(name=name, engine=remote, info=None, loaded_at=time.time(), memory_bytes=0,
                                    device="remote"), lane)
            return
        if explicit:
            self.crashes.forgive(served.ref)
        self.crashes.check(served.ref)
        lease = await self._acquire(served, lane, hold)
        try:
            yield lease
        finally:
            self._release(lease, keep_alive)

    def engines(self) -> dict[str, ModelEngine]:
        """The loaded models' engines by name (the dashboard reads their live views, engine/live.py)."""
        return {m.name: m.engine for m in self._loaded.values()}

    def status(self) -> list[dict[str, Any]]:
        now = time.time()
        waiting = {row["name"]: row for row in self._queues.rows()}
        rows = []
        for m in sorted(self._loaded.values(), key=lambda m: m.loaded_at):
            try:
                stats = m.engine.stats().to_dict()
            except Exception:  # a dying engine must not break /api/ps
                log.exception("stats of %s failed", m.name)
                stats = {}
            rows.append(loaded_row(m, stats, waiting.pop(m.name, {}), now, self.crashes.restarts[m.name]))
        for name in sorted(self._loading):
            rows.append(loading_row(name, self._reserved.get(name, 0), waiting.pop(name, {})))
        rows.extend(waiting.values())  # waiting for a model neither loaded nor loading
        rows.extend(failed_row(name, why, self.crashes.restarts[name]) for name, why in sorted(self.crashes.failed.items()))
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
        """Stop everything: in-flight requests are cancelled by their engines' shutdown, requests
        waiting for a load get 503."""
        self._closed = True
        if self._recheck is not None:
            self._recheck.cancel()
        self._queues.fail_all(lambda w: OverloadedError("the server is shutting down", retry_after=BUSY_RETRY_AFTER))
        await self._reaper.close()
        # A load running in a thread cannot be interrupted; wait for it so its engine is shut down too.
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        await asyncio.gather(*(self._unload(m) for m in list(self._loaded.values())), return_exceptions=True)
        await asyncio.gather(*(t for t, _ in list(self._unloading.values())), return_exceptions=True)

    # --- acquire / release -----------------------------------------------------------------
    async def _acquire(self, installed: InstalledModel, lane: Lane, hold: bool) -> Lease:
        if self._closed:
            raise OverloadedError("the server is shutting down", retry_after=BUSY_RETRY_AFTER)
        self._reaper.ensure_running()
        key = installed.ref
        model = self._loaded.get(key)
        if model is not None and not getattr(model.engine, "alive", True):
            model = await self._forgotten(model)
        if model is not None and swaps.admits(model.draining_for, lane):
            return self._new_lease(model, lane, hold)
        plan = await self._plan(installed)
        waiter = self._queues.add(swaps.Waiter(key, lane, installed, plan.memory_bytes, hold, plan=plan))
        self._tick()
        timeout = self.settings.queue_timeout or None
        try:
            await self._wait(waiter, timeout)
        except BaseException:  # the client left: give back a lease it got meanwhile
            if not waiter.future.cancel() and waiter.future.exception() is None:
                self._release(waiter.future.result(), None)
            raise
        finally:
            self._queues.discard(waiter)
        if waiter.future.cancel():
            self._tick()  # its place in the queue may have driven a swap
            raise OverloadedError(f"{key} waited {timeout:.0f} s to be loaded ({waiter.reason or 'no room'}); "
                                  "try again later", retry_after=BUSY_RETRY_AFTER)
        return waiter.future.result()  # a failed load raises its error here

    async def _forgotten(self, model: LoadedModel) -> LoadedModel | None:
        """What is loaded under `model`'s name once the loop has heard that its worker died: the
        reader thread that saw it posts _engine_died to this loop, and a request that came in
        between must load the model again, not lease the dead engine."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while self._loaded.get(model.name) is model and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._loaded.get(model.name)

    async def _wait(self, waiter: swaps.Waiter, timeout: float | None) -> None:
        """Until the waiter has its lease (or its load's error), or `timeout` seconds of waiting
        with no load of its model under way: a load that has started is waited for, however long
        the disk takes. wait(), not wait_for(): a timeout must not cancel a lease granted in the
        same moment."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not waiter.future.done():
            left = None if deadline is None else deadline - time.monotonic()
            if waiter.model in self._loading:
                left = None if left is None else max(1.0, left)  # look again after the load
            elif left is not None and left <= 0:
                return
            await asyncio.wait({waiter.future}, timeout=left)

    def _new_lease(self, model: LoadedModel, lane: Lane, hold: bool) -> Lease:
        lease = Lease(model, lane, hold)
        model.leases.add(lease)
        model.expires_at = None
        model.last_used = time.monotonic()
        return lease

    def _release(self, lease: Lease, keep_alive: float | None) -> None:
        model = lease.model
        was_leased = lease in model.leases
        lease.released = True
        model.leases.discard(lease)
        model.last_used = time.monotonic()
        if was_leased:
            model.keep_alive = self.settings.keep_alive if keep_alive is None else keep_alive
        if model.pinned == 0 and self._loaded.get(model.name) is model:
            self._reaper.idle(model)
        self._tick()

    async def _plan(self, installed: InstalledModel) -> ModelPlan:
        """The plan of a load of `installed` (once per file): its memory decides the swaps."""
        key = (installed.ref, installed.sha256 or "")
        if key not in self._planned:
            try:
                plan = await asyncio.to_thread(plan_model, installed, self.settings)
            except LocalserveError:
                raise
            except Exception:
                log.exception("planning %s failed", installed.ref)
                raise BackendError(f"model {installed.ref} cannot be loaded") from None
            self._planned[key] = plan
        return self._planned[key]

    # --- the scheduler of loads and swaps --------------------------------------------------
    def _tick(self) -> None:
        """Lease what can be leased, then let the best waiting request start its load or a swap."""
        if self._closed:
            return
        for w in self._queues.ordered():
            model = self._loaded.get(w.model)
            if model is not None and swaps.admits(model.draining_for, w.lane):
                self._grant(w, model)
        draining: dict[str, tuple[Lane, str]] = {}
        ahead: str | None = None
        for w in self._queues.ordered():
            if w.model in self._loaded or w.model in self._loading:
                w.reason = self._reason_loaded(w.model)
                continue
            if ahead is not None:
                w.reason = f"behind requests for {ahead} (a better lane or an earlier request)"
                continue
            decision = swaps.make_room(self._residents(), w.needed, self._room(), w.lane,
                                       min_residency=self.settings.swap_min_residency)
            for name in decision.unload:  # the load starts when their memory is back (_forget_unload)
                victim = self._loaded[name]
                self._begin_unload(victim, f"{'drained' if victim.draining_for else 'idle'}, to make room for {w.model}")
            if decision.ready and not decision.unload:
                self._start_load(w)
                w.reason = f"{w.model} is loading"
                continue
            for name in decision.preempt:
                self._preempt(self._loaded[name], w)
            for name in (*decision.preempt, *decision.drain):
                draining[name] = (w.lane, w.model)
            w.reason = self._reason_swap(decision, w)
            if decision.recheck_at is not None:
                self._schedule_recheck(decision.recheck_at)
            ahead = w.model
        for model in list(self._loaded.values()):
            model.draining_for, model.making_room_for = draining.get(model.name, (None, None))
            if model.draining_for and not model.work:
                self._begin_unload(model, f"drained, to make room for {model.making_room_for}")

    def _grant(self, waiter: swaps.Waiter, model: LoadedModel) -> None:
        lease = self._new_lease(model, waiter.lane, waiter.hold)
        if not waiter.grant(lease):  # cannot happen for an ordered() waiter; never leak a lease
            model.leases.discard(lease)
            return
        if not model.served:
            model.served = True
            log.info("%s: the first request after its load waited %.2fs (%s lane)", model.name,
                     time.monotonic() - waiter.since, waiter.lane)

    def _residents(self) -> list[swaps.Resident]:
        rows = [swaps.Resident(m.name, m.memory_bytes, m.resident_since, m.last_used, m.work)
                for m in self._loaded.values()]
        now = time.monotonic()
        rows += [swaps.Resident(name, size, now, now, (), loading=True) for name, size in self._reserved.items()]
        return rows

    def _room(self) -> swaps.Room:
        return swaps.Room(self.budget_bytes, self.settings.max_loaded_models, freeing=len(self._unloading),
                          freeing_bytes=sum(b for _, b in self._unloading.values()))

    def _preempt(self, model: LoadedModel, waiter: swaps.Waiter) -> None:
        """End the batch-lane work of `model` at its engine's next step; revoke its holds."""
        ended = 0
        for lease in list(model.leases):
            if lease.lane != swaps.PREEMPTIBLE_LANE or lease.preempted:
                continue
            lease.preempt()
            ended += not lease.hold
            if lease.hold:
                model.leases.discard(lease)
        if ended:
            log.info("swap: ending %d batch-lane requests of %s at a step boundary for a request for %s (%s lane)",
                     ended, model.name, waiter.model, waiter.lane)

    def _reason_loaded(self, name: str) -> str:
        if name in self._loading:
            return f"{name} is loading"
        model = self._loaded.get(name)
        if model is not None and model.making_room_for:
            return f"{name} is draining to make room for {model.making_room_for}"
        return ""

    def _reason_swap(self, decision: swaps.Eviction, waiter: swaps.Waiter) -> str:
        if decision.guarded:
            left = max(0.0, (decision.recheck_at or 0.0) - time.monotonic())
            return (f"{', '.join(decision.guarded)} must drain first; it keeps its slot for its minimum residency "
                    f"({self.settings.swap_min_residency:g} s) while it has work, {left:.1f} s more")
        if decision.preempt or decision.drain:
            parts = [f"{name} ({len(self._loaded[name].work)} running)" for name in (*decision.preempt, *decision.drain)]
            return f"{', '.join(parts)} must drain first (nothing in flight is aborted)"
        if decision.unload:
            return f"unloading {', '.join(decision.unload)} (idle) to make room"
        if self._loading or self._unloading:
            return "waiting for a load or unload in progress to finish"
        return "no room"

    def _schedule_recheck(self, at: float) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        self._recheck = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()) + 0.01, self._tick)

    def _retry_after(self, model: str) -> float:
        """Seconds until a full load queue has likely moved: what is left of the thrash guards of
        the busy models, and one load of `model` (as long as the last one took)."""
        now = time.monotonic()
        guards = [m.resident_since + self.settings.swap_min_residency - now for m in self._loaded.values() if m.work]
        return max(1.0, max(guards, default=0.0) + self._load_seconds.get(model, swaps.DEFAULT_RETRY_AFTER))

    # --- load / unload ---------------------------------------------------------------------
    def _start_load(self, waiter: swaps.Waiter) -> None:
        key = waiter.model
        self._reserved[key] = waiter.needed
        task = asyncio.create_task(self._load(key, waiter.installed, waiter.plan), name=f"load {key}")
        self._loading[key] = task
        task.add_done_callback(lambda t, key=key: self._load_done(key, t))

    def _load_done(self, key: str, task: asyncio.Task[LoadedModel]) -> None:
        self._loading.pop(key, None)
        self._reserved.pop(key, None)
        error = task.exception() if not task.cancelled() else OverloadedError("the load was cancelled")
        if error is not None:  # every request waiting for this load shares its failure
            self._queues.fail_all(lambda w: error, model=key)
        self._tick()

    async def _load(self, key: str, installed: InstalledModel, plan: ModelPlan) -> LoadedModel:
        needed = plan.memory_bytes
        if needed > self.budget_bytes:
            log.warning("%s needs ~%d MiB, more than the %d MiB budget; loading it alone",
                        key, needed >> 20, self.budget_bytes >> 20)
        if (backoff := self.crashes.backoff(key)) > 0:  # it crashed lately: do not reload it in a loop
            log.info("%s: its engine stopped lately; loading it again in %.1f s", key, backoff)
            await asyncio.sleep(backoff)
        try:
            started = time.monotonic()
            engine = await asyncio.to_thread(self._loader, installed, self.settings)
        except EngineCrashedError as e:  # its worker died loading it: counts as a crash (crashes.py)
            self.crashes.record(key, e.reason)
            raise
        except LocalserveError:
            log.warning("loading %s failed", key, exc_info=True)
            raise
        except Exception:
            # The details (paths, llama.cpp messages) go to the log only.
            log.exception("loading %s failed", key)
            raise BackendError(f"model {key} failed to load") from None
        self._load_seconds[key] = seconds = time.monotonic() - started
        log.info("loaded %s in %.2fs (estimated %d MiB)", key, seconds, needed >> 20)
        model = LoadedModel(name=key, engine=engine, info=installed, loaded_at=time.time(), memory_bytes=needed,
                            device=plan.device, vram_bytes=plan.vram_bytes, keep_alive=self.settings.keep_alive,
                            expires_at=time.time() + self.settings.keep_alive)
        if self._closed:
            await self._shutdown_engine(model)
            raise OverloadedError("the server is shutting down", retry_after=BUSY_RETRY_AFTER)
        self._loaded[key] = model
        if isinstance(engine, WorkerEngine):
            loop = asyncio.get_running_loop()
            engine.on_exit(lambda reason, model=model: loop.call_soon_threadsafe(self._engine_died, model, reason))
        self._reaper.wake()
        return model

    def _engine_died(self, model: LoadedModel, reason: str) -> None:
        """Its worker died and ended its requests (their leases go as they finish): forget the
        model, so the next request loads it again (after a backoff), unless it keeps dying."""
        self.crashes.record(model.name, reason)
        if model.name in self.crashes.failed:
            log.error("%s: %s", model.name, self.crashes.failed[model.name])
        if self._loaded.get(model.name) is model:
            del self._loaded[model.name]
            model.revoke_holds()
            # Nothing to free but the pipe: the process is gone.
            asyncio.create_task(self._shutdown_engine(model), name=f"close {model.name}")
        if model.name in self.crashes.failed:  # requests queued for it meanwhile are not left waiting
            self._queues.fail_all(lambda w: self.crashes.error(w.model), model=model.name)
        self._tick()

    def _begin_unload(self, model: LoadedModel, why: str = "") -> asyncio.Task[None] | None:
        """Take `model` out of the loaded set now and shut its engine down in a thread; its memory
        counts as used until that is done. None when it is not (or no longer) loaded."""
        if self._loaded.get(model.name) is not model:
            return None
        del self._loaded[model.name]
        model.revoke_holds()
        if why:
            log.info("swap: unloading %s (resident %.1fs, %s)", model.name, time.monotonic() - model.resident_since, why)
        task = asyncio.create_task(self._shutdown_engine(model), name=f"unload {model.name}")
        self._unloading[model.name] = (task, model.memory_bytes)
        # Cleared by the task itself, not by whoever awaits it: a waiter may be cancelled, and a
        # leftover entry would count freed memory as used forever.
        task.add_done_callback(lambda t, name=model.name: self._forget_unload(name, t))
        return task

    async def _unload(self, model: LoadedModel) -> None:
        task = self._begin_unload(model)
        if task is not None:
            await asyncio.shield(task)

    def _forget_unload(self, name: str, task: asyncio.Task[None]) -> None:
        if self._unloading.get(name, (None, 0))[0] is task:
            del self._unloading[name]
        self._tick()  # its memory is back: a waiting load may fit now

    async def _shutdown_engine(self, model: LoadedModel) -> None:
        try:
            await asyncio.to_thread(model.engine.shutdown, UNLOAD_TIMEOUT)
            log.info("unloaded %s", model.name)
        except Exception:
            log.exception("unloading %s failed", model.name)

    # --- helpers ---------------------------------------------------------------------------
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
