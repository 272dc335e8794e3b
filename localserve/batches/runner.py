"""Runs batches on the `batch` lane and finalizes them.

Order: oldest first within a queue (queues.py) -- batches on local models one at a time, each
upstream model a queue of its own -- so a batch waiting for an upstream that is down holds no
batch on another model.

A batch's lines are sorted so that lines sharing a prompt prefix run next to each other (the
prefix cache then serves the shared part), and `width` of them are in flight at once: twice the
model's max_sequences by default, so the continuous batch stays full with the next line already
queued while nothing else runs; the scheduler puts interactive and default lanes first whenever
they have work. Every model a batch's lines use is held (ModelManager.hold) until the batch ends,
so it is loaded once and never unloaded by keep_alive between lines; a swap for a better lane's request
for another model may end the batch's lines at a step boundary (SwapPreemptedError), and those lines
run again once the model is back, each recorded once. Lines go through the engine
protocol only (ModelManager -> ModelEngine), whatever engine serves the model. A line refused for
now (its lane is full, its model loading, every upstream of it down) is tried again until the
completion window ends.

States: validating (created; the file was checked at create, room for it too) -> in_progress ->
finalizing -> completed; cancelling -> cancelled; expired when completion_window passes first
(through finalizing); failed only when a bug inside the server stops the batch (logged; every
recorded result stays in the store).

Results are never lost to the disk. A finalize whose files do not fit keeps the batch finalizing
(or cancelling) with every result in the store; it is finished when room returns, tried again
every ROOM_RETRY_S and at the next start. Any storage error (SQLite's full disk or I/O error
included) leaves the batch in its state, logged with its id and the reason, and it is tried again
after STORAGE_RETRY_S: unrecorded lines run again, recorded ones never do. The runner itself
outlives both. On start every unfinished batch resumes the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sqlite3
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..config.settings import Settings
from ..errors import DiskFullError, InvalidRequestError, NotFoundError, OverloadedError, QueueFullError, SwapPreemptedError
from ..api.live import ORIGIN, Origin
from ..api.openai import ApiEnv
from .files import FileStorage, dumps, file_object, new_id
from .jsonl import read_input
from .lines import ENDPOINTS, Outcome, first_model, run_line, sort_pending
from .queues import queues_of, overlap
from .store import TERMINAL, BatchStore

if TYPE_CHECKING:
    from ..runtime.loaded import Lease
    from ..runtime.manager import ModelManager
    from ..api.metrics import Metrics

log = logging.getLogger(__name__)
DEFAULT_WIDTH = 16  # lines in flight when the model's max_sequences is unknown (it failed to load)
RETRY_S = 5.0  # longest wait before retrying a line the lane refused (full) or a loading model held
ROOM_RETRY_S = 30.0  # between tries of a finalize that found the disk too full for its files
STORAGE_RETRY_S = 10.0  # before a batch (or the queue) that hit a storage error is tried again
STORAGE_ERRORS = (sqlite3.Error, OSError)
ENDED = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
QUIET = ("finalizing", "cancelling")  # states that run no lines: they hold no queue


class BatchRunner:
    def __init__(self, settings: Settings, manager: "ModelManager", metrics: "Metrics | None" = None):
        self.settings = settings
        self.manager = manager
        self.store = BatchStore(settings.batches_dir / "batches.sqlite3")
        self.files = FileStorage(settings.batches_dir / "files", settings.batch_min_free_disk)
        self.env = ApiEnv(settings, manager, metrics, "batch")
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # starting a batch vs cancelling one
        self._running: dict[str, asyncio.Event] = {}  # running batch -> its stop (a cancel sets it)
        self._tasks: set[asyncio.Task[None]] = set()
        self._retry_at: dict[str, float] = {}  # set-back batch -> time.monotonic() it is tried again
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.call(lambda: self.files.sweep(self.store.file_ids()))
        self._task = asyncio.create_task(self._loop(), name="batch runner")

    async def close(self) -> None:
        """Stop (in-flight lines are cancelled and stay pending: the next start runs them)."""
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.store.close()

    # --- API -------------------------------------------------------------------------------
    async def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        await self.store.call(self.store.get_file, input_file_id)  # 404 first
        try:
            data = await asyncio.to_thread(read_input, self.files.path(input_file_id), self.settings)
        except FileNotFoundError:  # deleted since the lookup: the answer a create after the delete gets
            raise NotFoundError(f"no file with id {input_file_id[:80]!r}", param="input_file_id") from None
        await asyncio.to_thread(self.files.check_room, data.input_bytes + 2 * data.worst_output_bytes,
                                "this batch (its input and the largest output its lines allow)")
        now = int(time.time())
        batch = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": "24h", "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + int(self.settings.batch_completion_window), "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "metadata": metadata,
            # The exact deadline (expires_at is whole seconds, as OpenAI's): short test windows.
            "_expires": time.time() + self.settings.batch_completion_window,
            "_models": None if data.models is None else sorted(data.models),  # its queues (queues.py)
        }
        await self.store.call(self.store.create_batch, batch, data.lines)
        self._wake.set()
        return public(await self.store.call(self.store.get_batch, batch["id"]))

    async def get(self, batch_id: str) -> dict[str, Any]:
        return public(await self.store.call(self.store.get_batch, batch_id))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        async with self._lock:
            batch = await self.store.call(self.store.get_batch, batch_id)
            # A finalizing batch has every line answered: nothing is left to cancel.
            if batch["status"] in TERMINAL or batch["status"] in QUIET:
                return public(batch)
            await self.store.call(lambda: self.store.update_batch(
                batch_id, status="cancelling", cancelling_at=int(time.time())))
            if (stop := self._running.get(batch_id)) is not None:
                stop.set()  # the running batch stops its lines and finalizes itself
            else:
                try:
                    await self._finalize(batch_id, "cancelled")  # nobody runs it: the lock keeps it so
                except (DiskFullError, *STORAGE_ERRORS) as e:
                    self._set_back(batch_id, e)  # it stays cancelling; the loop finishes it
                    self._wake.set()
        return await self.get(batch_id)

    # --- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                delay = await self._schedule()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the store itself failing must not end the runner
                log.exception("the batch runner could not read its queue; trying again in %.0f s", STORAGE_RETRY_S)
                delay = STORAGE_RETRY_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _schedule(self) -> float | None:
        """Start each unfinished batch that shares no queue with an older one; the seconds until
        the soonest set-back batch is due (None: none is)."""
        due: float | None = None
        async with self._lock:
            queue = await self.store.call(self.store.unfinished)
            now = time.monotonic()
            held: list[frozenset[str]] = []
            for batch_id, status, models in queue:
                needs = frozenset() if status in QUIET else queues_of(models, self._is_remote)
                waits = any(overlap(needs, h) for h in held)
                held.append(needs)  # a set-back batch keeps its place too: a queue stays in order
                if batch_id in self._running or waits:
                    continue
                if (wait := self._retry_at.get(batch_id, 0.0) - now) > 0:
                    due = wait if due is None else min(due, wait)
                    continue
                self._launch(batch_id)
        return due

    def _is_remote(self, model: str) -> bool:
        pool = self.manager.upstreams
        return pool is not None and bool(pool.candidates(model))

    def _launch(self, batch_id: str) -> None:
        stop = self._running[batch_id] = asyncio.Event()
        task = asyncio.create_task(self._guarded(batch_id, stop), name=f"batch {batch_id}")
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, batch_id))

    def _ended(self, batch_id: str, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        self._running.pop(batch_id, None)
        self._wake.set()  # its queue is free, or it is due again later

    async def _guarded(self, batch_id: str, stop: asyncio.Event) -> None:
        """`_process`, every failure logged with the batch's id and survived."""
        try:
            await self._process(batch_id, stop)
            self._retry_at.pop(batch_id, None)
        except asyncio.CancelledError:
            raise
        except (DiskFullError, *STORAGE_ERRORS) as e:
            self._set_back(batch_id, e)
        except Exception:  # noqa: BLE001 - a bug in one batch must not stop the others
            log.exception("batch %s failed", batch_id)
            try:
                await self.store.call(lambda: self.store.update_batch(
                    batch_id, status="failed", failed_at=int(time.time()),
                    errors=batch_errors("internal_error", "the batch failed inside the server")))
            except Exception as e:  # noqa: BLE001 - the store failing too: try the batch again later
                self._set_back(batch_id, e)

    def _set_back(self, batch_id: str, error: Exception) -> None:
        """Leave the batch as it is (results recorded, lines pending) and try it again later."""
        room = isinstance(error, DiskFullError)
        delay = ROOM_RETRY_S if room else STORAGE_RETRY_S
        self._retry_at[batch_id] = time.monotonic() + delay
        reason = error.message if room else f"storage error, {type(error).__name__}: {error}"
        log.error("batch %s: %s; it keeps its state and every recorded result, and is tried again in %.0f s",
                  batch_id, reason, delay)

    async def _process(self, batch_id: str, stop: asyncio.Event) -> None:
        batch = await self.store.call(self.store.get_batch, batch_id)
        status = batch["status"]
        if status == "cancelling":
            return await self._finalize(batch_id, "cancelled")
        if status == "finalizing":
            return await self._finalize(batch_id, batch.get("_outcome", "completed"))
        if time.time() < batch["_expires"]:
            if status == "validating":
                await self.store.call(lambda: self.store.update_batch(
                    batch_id, status="in_progress", in_progress_at=int(time.time())))
            if not await self._run_lines(batch, stop):
                return await self._finalize(batch_id, "cancelled" if stop.is_set() else "expired")
        elif await self.store.call(self.store.pending_lines, batch_id):
            return await self._finalize(batch_id, "expired")
        await self._finalize(batch_id, "completed")

    async def _run_lines(self, batch: dict[str, Any], stop: asyncio.Event) -> bool:
        """Run every pending line; False if cancelled or expired first (pending lines remain)."""
        pending = await self.store.call(self.store.pending_lines, batch["id"])
        queue = deque(await asyncio.to_thread(sort_pending, pending, self.settings.max_body_bytes))
        async with contextlib.AsyncExitStack() as pins:
            pin = Pins(self.manager, pins)
            width = await self._width(pin, queue)
            workers = [asyncio.create_task(self._work(batch, queue, pin)) for _ in range(min(width, len(queue)))]
            if not workers:
                return True
            stopped = asyncio.create_task(stop.wait())
            done_all = asyncio.gather(*workers)
            try:
                await asyncio.wait({done_all, stopped}, timeout=max(0.0, batch["_expires"] - time.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if done_all.done():
                    done_all.result()  # a worker's bug or storage error surfaces here
                    return True
                return False
            finally:
                # Every worker, not only the gather: one that raised leaves its siblings running,
                # and they must not outlive the models pinned for them.
                for task in (*workers, stopped):
                    task.cancel()
                await asyncio.gather(*workers, done_all, stopped, return_exceptions=True)

    async def _width(self, pin: "Pins", queue: deque) -> int:
        """Lines in flight: the setting, else twice the first model's max_sequences (pinned here)."""
        if self.settings.batch_in_flight:
            return self.settings.batch_in_flight
        model = await asyncio.to_thread(first_model, list(queue), self.settings.default_model,
                                        self.settings.max_body_bytes)
        loaded = None
        with contextlib.suppress(Exception):  # an unknown model: its lines will report it
            loaded = await pin.model(model)
        max_seq = loaded.engine.stats().max_sequences if loaded is not None else 0
        return max(1, min(self.settings.queue_size, 2 * max_seq if max_seq else DEFAULT_WIDTH))

    async def _work(self, batch: dict[str, Any], queue: deque, pin: "Pins") -> None:
        endpoint = batch["endpoint"]
        while queue:
            idx, custom_id, raw = queue.popleft()
            live = self.env.metrics.live if self.env.metrics is not None else None
            while True:
                # The dashboard shows the line's stream as batch traffic, timed from this attempt.
                origin = Origin("batch", endpoint, tracker=live)
                ORIGIN.set(origin)
                try:
                    outcome = await run_line(raw, endpoint, self.env, pin.__call__)
                    if live is not None:
                        live.count(origin)
                    break
                except SwapPreemptedError:
                    # Ended unanswered for a better-lane request's model: run it again now; it waits
                    # in the batch lane until its model is back, and is recorded only once it ran.
                    continue
                except (QueueFullError, OverloadedError) as e:
                    await asyncio.sleep(min(e.retry_after, RETRY_S))
            line = result_line(batch["id"], idx, custom_id, outcome)
            await self.store.call(self.store.record, batch["id"], idx, line, not outcome.ok)

    async def _finalize(self, batch_id: str, outcome: str) -> None:
        """Close unfinished lines (cancelled/expired), write the files, set the final state. A
        DiskFullError leaves the batch finalizing (a cancel: cancelling) for a later try."""
        if outcome != "cancelled":  # a cancel shows `cancelling` until it is done, as OpenAI's
            # First, so a kill or a full disk after the lines are closed still finishes as `outcome`.
            await self.store.call(self._mark_finalizing, batch_id, outcome)
        if outcome in ENDED:
            code = ENDED[outcome]
            message = (f"This request was not run: the batch was {outcome}"
                       + (" before its completion window ended." if outcome == "expired" else "."))
            await self.store.call(self.store.close_pending, batch_id, lambda idx, cid: dumps({
                "id": line_id(batch_id, idx), "custom_id": cid, "response": None,
                "error": {"code": code, "message": message}}))
        fields = await self.store.call(self._write_files, batch_id)
        await self.store.call(lambda: self.store.update_batch(
            batch_id, status=outcome, **{f"{outcome}_at": int(time.time())}, **fields))

    def _mark_finalizing(self, batch_id: str, outcome: str) -> None:
        """(In a worker thread.) Status finalizing, with the outcome it finalizes to; once."""
        if self.store.get_batch(batch_id)["status"] != "finalizing":
            self.store.update_batch(batch_id, status="finalizing", finalizing_at=int(time.time()), _outcome=outcome)

    def _write_files(self, batch_id: str) -> dict[str, Any]:
        """(In a worker thread.) The output and error files from the recorded lines, each under an
        id derived from the batch's, so a finalize interrupted by a kill rewrites the same files."""
        counts = self.store.get_batch(batch_id)["request_counts"]
        fields: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
        for key, is_error, kind in (("output_file_id", False, "output"), ("error_file_id", True, "error")):
            if not counts["failed" if is_error else "completed"]:
                continue
            file_id = f"file-{kind}-{batch_id.removeprefix('batch_')}"
            size = self.files.write_lines(file_id, self.store.results(batch_id, is_error))
            self.store.add_file(file_object(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", size))
            fields[key] = file_id
        return fields


class Pins:
    """The models a batch uses, each held for the batch's lifetime (released by `stack`). A hold
    keeps the model loaded between lines but is no work: a swap may revoke it (runtime/swaps.py),
    and the next line that needs the model takes a new hold, waiting in the batch lane until the
    model is back."""

    def __init__(self, manager: "ModelManager", stack: contextlib.AsyncExitStack):
        self.manager = manager
        self.stack = stack
        self.pinned: dict[str, "Lease"] = {}
        self.lock = asyncio.Lock()

    async def model(self, name: str) -> "Lease":
        async with self.lock:
            if name not in self.pinned or self.pinned[name].revoked:
                self.pinned[name] = await self.stack.enter_async_context(self.manager.hold(name))
            return self.pinned[name]

    async def __call__(self, name: str) -> None:
        await self.model(name)


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch object (without our private fields)."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}


def batch_errors(code: str, message: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}


def line_id(batch_id: str, idx: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{idx}"


def result_line(batch_id: str, idx: int, custom_id: str | None, outcome: Outcome) -> str:
    """OpenAI's output/error line: the endpoint's status and body under `response`."""
    return dumps({"id": line_id(batch_id, idx), "custom_id": custom_id, "error": None, "response": {
        "status_code": outcome.status, "request_id": f"req_{new_id('')}", "body": outcome.body}})


def check_endpoint(endpoint: Any) -> str:
    if endpoint not in ENDPOINTS:
        raise InvalidRequestError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    return endpoint
