"""Runs batches, one at a time in creation order, on the `batch` lane, and finalizes them.

A batch's lines are sorted so that lines sharing a prompt prefix run next to each other (the
prefix cache then serves the shared part), and `width` of them are in flight at once: twice the
model's max_sequences by default, so the continuous batch stays full with the next line already
queued while nothing else runs; the scheduler puts interactive and default lanes first whenever
they have work. Every model a batch's lines use is pinned (ModelManager.use) until the batch ends,
so it is loaded once and never unloaded by keep_alive between lines. Lines go through the engine
protocol only (ModelManager -> ModelEngine), whatever engine serves the model.

States: validating (created; the file was checked at create) -> in_progress -> finalizing ->
completed; cancelling -> cancelled; expired when completion_window passes first; failed when the
result files cannot be written (disk full; every recorded result stays in the store). On start
every unfinished batch resumes: its unrecorded lines run again, recorded ones never do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..errors import DiskFullError, InvalidRequestError, OverloadedError, QueueFullError
from ..server.openai_api import ApiEnv
from .files import FileStorage, dumps, file_object, new_id
from .jsonl import read_input
from .lines import ENDPOINTS, Outcome, run_line
from .store import TERMINAL, BatchStore

if TYPE_CHECKING:
    from ..models import LoadedModel, ModelManager
    from ..server.metrics import Metrics

log = logging.getLogger(__name__)
DEFAULT_WIDTH = 16  # lines in flight when the model's max_sequences is unknown (it failed to load)
RETRY_S = 5.0  # longest wait before retrying a line the lane refused (full) or a loading model held
ENDED = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def batches_dir(settings: Settings) -> Path:
    return settings.home / "batches"


class BatchRunner:
    def __init__(self, settings: Settings, manager: "ModelManager", metrics: "Metrics | None" = None):
        self.settings = settings
        self.manager = manager
        self.store = BatchStore(batches_dir(settings) / "batches.sqlite3")
        self.files = FileStorage(batches_dir(settings) / "files", settings.batch_min_free_disk)
        self.env = ApiEnv(settings, manager, metrics, "batch")
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # picking the current batch vs cancelling one
        self._current: str | None = None
        self._stop = asyncio.Event()  # the current batch was cancelled
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.call(lambda: self.files.sweep(self.store.file_ids()))
        self._task = asyncio.create_task(self._loop(), name="batch runner")

    async def close(self) -> None:
        """Stop (in-flight lines are cancelled and stay pending: the next start runs them)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.store.close()

    # --- API -------------------------------------------------------------------------------
    async def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        await self.store.call(self.store.get_file, input_file_id)  # 404 first
        lines = await asyncio.to_thread(read_input, self.files.path(input_file_id),
                                        self.settings.batch_max_file_bytes, self.settings.batch_max_lines)
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
        }
        await self.store.call(self.store.create_batch, batch, lines)
        self._wake.set()
        return public(await self.store.call(self.store.get_batch, batch["id"]))

    async def get(self, batch_id: str) -> dict[str, Any]:
        return public(await self.store.call(self.store.get_batch, batch_id))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        async with self._lock:
            batch = await self.store.call(self.store.get_batch, batch_id)
            if batch["status"] in TERMINAL or batch["status"] == "cancelling":
                return public(batch)
            await self.store.call(lambda: self.store.update_batch(
                batch_id, status="cancelling", cancelling_at=int(time.time())))
            if batch_id == self._current:
                self._stop.set()  # the running batch stops its lines and finalizes itself
            else:
                await self._finalize(batch_id, "cancelled")  # nobody runs it: the lock keeps it so
        return await self.get(batch_id)

    # --- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            async with self._lock:
                queue = await self.store.call(self.store.unfinished)
                self._current = queue[0][0] if queue else None
                self._stop.clear()
            if self._current is None:
                await self._wake.wait()
                continue
            try:
                await self._process(self._current)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one broken batch must not stop the others
                log.exception("batch %s failed", self._current)
                await self.store.call(lambda: self.store.update_batch(
                    self._current, status="failed", failed_at=int(time.time()),
                    errors=batch_errors("internal_error", "the batch failed inside the server")))
            finally:
                async with self._lock:
                    self._current = None

    async def _process(self, batch_id: str) -> None:
        batch = await self.store.call(self.store.get_batch, batch_id)
        status = batch["status"]
        if status == "cancelling":
            return await self._finalize(batch_id, "cancelled")
        if status != "finalizing":
            if time.time() < batch["_expires"]:
                if status == "validating":
                    await self.store.call(lambda: self.store.update_batch(
                        batch_id, status="in_progress", in_progress_at=int(time.time())))
                if not await self._run_lines(batch):
                    return await self._finalize(batch_id, "cancelled" if self._stop.is_set() else "expired")
            elif await self.store.call(self.store.pending_lines, batch_id):
                return await self._finalize(batch_id, "expired")
        await self._finalize(batch_id, "completed")

    async def _run_lines(self, batch: dict[str, Any]) -> bool:
        """Run every pending line; False if cancelled or expired first (pending lines remain)."""
        pending = await self.store.call(self.store.pending_lines, batch["id"])
        queue = deque(sorted(pending, key=lambda line: prefix_key(line[2])))
        async with contextlib.AsyncExitStack() as pins:
            pin = Pins(self.manager, pins)
            width = await self._width(pin, queue)
            workers = [asyncio.create_task(self._work(batch, queue, pin)) for _ in range(min(width, len(queue)))]
            if not workers:
                return True
            stop = asyncio.create_task(self._stop.wait())
            done_all = asyncio.gather(*workers)
            try:
                await asyncio.wait({done_all, stop}, timeout=max(0.0, batch["_expires"] - time.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if done_all.done():
                    done_all.result()  # a worker's bug surfaces here
                    return True
                return False
            finally:
                stop.cancel()
                done_all.cancel()
                await asyncio.gather(done_all, stop, return_exceptions=True)

    async def _width(self, pin: "Pins", queue: deque) -> int:
        """Lines in flight: the setting, else twice the first model's max_sequences (pinned here)."""
        if self.settings.batch_in_flight:
            return self.settings.batch_in_flight
        model = first_model(queue, self.settings.default_model)
        loaded = None
        with contextlib.suppress(Exception):  # an unknown model: its lines will report it
            loaded = await pin.model(model)
        max_seq = loaded.engine.stats().max_sequences if loaded is not None else 0
        return max(1, min(self.settings.queue_size, 2 * max_seq if max_seq else DEFAULT_WIDTH))

    async def _work(self, batch: dict[str, Any], queue: deque, pin: "Pins") -> None:
        endpoint = batch["endpoint"]
        while queue:
            idx, custom_id, raw = queue.popleft()
            while True:
                try:
                    outcome = await run_line(raw, endpoint, self.env, pin.__call__)
                    break
                except (QueueFullError, OverloadedError) as e:
                    await asyncio.sleep(min(e.retry_after, RETRY_S))
            line = result_line(batch["id"], idx, custom_id, outcome)
            await self.store.call(self.store.record, batch["id"], idx, line, not outcome.ok)

    async def _finalize(self, batch_id: str, outcome: str) -> None:
        """Close unfinished lines (cancelled/expired), write the files, set the final state."""
        now = int(time.time())
        if outcome in ENDED:
            code = ENDED[outcome]
            message = (f"This request was not run: the batch was {outcome}"
                       + (" before its completion window ended." if outcome == "expired" else "."))
            await self.store.call(self.store.close_pending, batch_id, lambda idx, cid: dumps({
                "id": line_id(batch_id, idx), "custom_id": cid, "response": None,
                "error": {"code": code, "message": message}}))
        else:
            await self.store.call(lambda: self.store.update_batch(batch_id, status="finalizing", finalizing_at=now))
        try:
            fields = await self.store.call(self._write_files, batch_id)
        except DiskFullError as e:
            log.error("batch %s failed: %s", batch_id, e.message)
            await self.store.call(lambda: self.store.update_batch(
                batch_id, status="failed", failed_at=int(time.time()), errors=batch_errors("disk_full", e.message)))
            return
        await self.store.call(lambda: self.store.update_batch(
            batch_id, status=outcome, **{f"{outcome}_at": int(time.time())}, **fields))

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
    """The models a batch uses, each pinned once for the batch's lifetime (released by `stack`)."""

    def __init__(self, manager: "ModelManager", stack: contextlib.AsyncExitStack):
        self.manager = manager
        self.stack = stack
        self.pinned: dict[str, "LoadedModel"] = {}
        self.lock = asyncio.Lock()

    async def model(self, name: str) -> "LoadedModel":
        async with self.lock:
            if name not in self.pinned:
                self.pinned[name] = await self.stack.enter_async_context(self.manager.use(name))
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


def _body(raw: str) -> dict[str, Any]:
    try:
        line = json.loads(raw)
        body = line.get("body") if isinstance(line, dict) else None
        return body if isinstance(body, dict) else {}
    except (ValueError, RecursionError):
        return {}


def prefix_key(raw: str) -> str:
    """Lines whose prompts share a beginning sort next to each other: the model, then the
    messages/prompt/input as JSON text (a shared system prompt is a shared prefix of that text)."""
    body = _body(raw)
    prompt = body.get("messages", body.get("prompt", body.get("input", "")))
    try:
        return f"{body.get('model', '')}\0{json.dumps(prompt, ensure_ascii=False)}"
    except (TypeError, ValueError):
        return ""


def first_model(queue: deque, default: str) -> str:
    for _, _, raw in queue:
        model = _body(raw).get("model")
        if isinstance(model, str) and model:
            return model
    return default


def check_endpoint(endpoint: Any) -> str:
    if endpoint not in ENDPOINTS:
        raise InvalidRequestError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    return endpoint
