"""Batches held at a known point: the real server (aiohttp app, runner, SQLite, files) on a fake
upstream whose answers the test lets out one by one (gated_upstream.py), so a cancel, an expiry, a
full disk or a failing database hit the batch exactly where the test says, however fast the machine:
- cancel after exactly 2 answered lines (28 cancelled), a queued batch on the same model cancelled
  at once, expiry with every held line expired -- each custom_id exactly once (issue 25, item 9);
- a batch whose files do not fit stays `finalizing` with its results and completes after a restart
  with room; a create that does not fit is a 507 in OpenAI's error shape;
- SQLite refusing to grow (a full database) sets the batch back, logged with its id and why; the
  runner keeps running other batches, and the batch completes once the database can grow;
- a batch on an upstream that is down does not hold a later batch on another model.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterator

import openai
import pytest

from daemon_util import free_port
from gated_upstream import GatedUpstream, vector
from localserve.server.batch_routes import BATCHES_KEY  # first: localserve.batches and .server import each other
from localserve.batches.lines import run_line
from localserve.config.upstreams import parse_upstreams
from server_harness import LiveServer, server_settings

MODELS = ("g-cancel", "g-expire", "g-disk", "g-room", "g-sqlite", "g-open")
DOWN = {"name": "down", "url": f"http://127.0.0.1:{free_port()}/v1", "models": ["down-model"]}  # nothing listens
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def gate() -> Iterator[GatedUpstream]:
    with GatedUpstream(*MODELS) as upstream:
        yield upstream


def settings_for(home: Any, gate: GatedUpstream) -> Any:
    return server_settings(home, upstreams=parse_upstreams([gate.table(), DOWN]), upstream_health_interval=1.0)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, gate: GatedUpstream) -> Iterator[LiveServer]:
    with LiveServer(settings_for(tmp_path_factory.mktemp("gated"), gate)) as server:
        yield server


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def emb_line(cid: str, model: str, text: str, **extra: Any) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": model, "input": text, **extra}})


def submit(client: openai.OpenAI, model: str, n: int, prefix: str, **extra: Any) -> Any:
    data = "".join(emb_line(f"{prefix}{i}", model, f"{prefix} text {i}", **extra) + "\n" for i in range(n))
    f = client.files.create(file=("in.jsonl", data.encode()), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")


def until(client: openai.OpenAI, batch_id: str, check: Callable[[Any], bool], timeout: float = 120) -> Any:
    """Poll until `check(batch)` holds; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not check(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"batch {batch_id} stuck at {batch.status} {batch.request_counts}"
        time.sleep(0.05)
    return batch


def final(client: openai.OpenAI, batch_id: str) -> Any:
    return until(client, batch_id, lambda b: b.status in FINAL)


def contents(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(l) for l in client.files.content(file_id).text.splitlines()] if file_id else []


def exactly_once(client: openai.OpenAI, done: Any, prefix: str, n: int, dims: int = 2) -> tuple[dict, dict]:
    """The output and error lines by custom_id; each of the batch's custom_ids in exactly one."""
    out, errors = contents(client, done.output_file_id), contents(client, done.error_file_id)
    ids = [x["custom_id"] for x in out + errors]
    assert sorted(ids) == sorted(f"{prefix}{i}" for i in range(n))
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(errors))
    for item in out:
        i = int(item["custom_id"].removeprefix(prefix))
        assert item["response"]["body"]["data"][0]["embedding"] == vector(f"{prefix} text {i}", dims)
    return {x["custom_id"]: x for x in out}, {x["custom_id"]: x for x in errors}


def test_cancel_after_two_lines_and_a_queued_batch_cancels_at_once(live, gate):
    client = client_of(live)
    batch = submit(client, "g-cancel", 30, "k")
    queued = submit(client, "g-cancel", 3, "q")  # same model: it waits for `batch`, held by the gate
    assert client.batches.cancel(queued.id).status == "cancelled"  # nobody runs it: no wait
    _, errors = exactly_once(client, client.batches.retrieve(queued.id), "q", 3)
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}

    gate.release("g-cancel", 2)
    until(client, batch.id, lambda b: b.request_counts.completed == 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = final(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    out, errors = exactly_once(client, done, "k", 30)
    assert len(out) == 2 and len(errors) == 28
    assert all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors.values())


def test_expiry_closes_every_held_line(live, gate):
    client = client_of(live)
    live.settings.batch_completion_window = 1.0
    try:
        batch = submit(client, "g-expire", 20, "x")
    finally:
        live.settings.batch_completion_window = 86_400.0
    gate.wait_for(lambda g: g.received["g-expire"] > 0)  # running, its lines held: none can be answered
    done = final(client, batch.id)
    assert done.status == "expired" and done.expired_at and done.finalizing_at
    out, errors = exactly_once(client, done, "x", 20)
    assert not out and {e["error"]["code"] for e in errors.values()} == {"batch_expired"}


def test_create_without_room_is_a_507(live):
    client = client_of(live)
    runner = live.runner.app[BATCHES_KEY]
    f = client.files.create(file=("in.jsonl", (emb_line("a", "g-open", "t") + "\n").encode()), purpose="batch")
    runner.files.min_free = 1 << 62  # no disk has this much free
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    finally:
        runner.files.min_free = live.settings.batch_min_free_disk
    assert e.value.status_code == 507
    error = e.value.body
    assert "batch_min_free_disk" in error["message"] and str(live.settings.home) not in error["message"]
    assert error["type"] and "code" in error
    assert not [b for b in client.batches.list(limit=100).data if b.input_file_id == f.id]


def test_full_disk_keeps_the_results_and_a_restart_with_room_finishes(tmp_path, gate, caplog):
    settings = settings_for(tmp_path, gate)
    with LiveServer(settings) as live:
        client = client_of(live)
        batch = submit(client, "g-disk", 6, "d")
        # From here no batch file fits; the gate holds every line, so none has an answer yet.
        live.runner.app[BATCHES_KEY].files.min_free = 1 << 62
        gate.open("g-disk")
        held = until(client, batch.id, lambda b: b.status == "finalizing" and b.request_counts.completed == 6)
        assert held.output_file_id is None and held.failed_at is None
        until(client, batch.id, lambda b: any(batch.id in r.getMessage() and "not enough free disk" in r.getMessage()
                                               for r in caplog.records))
        assert client.batches.retrieve(batch.id).status == "finalizing"
    with LiveServer(settings) as live:  # batch_min_free_disk as configured: room again
        client = client_of(live)
        done = final(client, batch.id)
        assert done.status == "completed" and done.completed_at and done.error_file_id is None
        out, _ = exactly_once(client, done, "d", 6)
        assert len(out) == 6


def test_a_finalize_without_room_finishes_on_a_later_loop_once_room_returns(live, gate, monkeypatch):
    monkeypatch.setattr("localserve.batches.runner.ROOM_RETRY_S", 0.2)  # the loop's retry period, shortened
    client = client_of(live)
    files = live.runner.app[BATCHES_KEY].files
    batch = submit(client, "g-room", 3, "r")
    files.min_free = 1 << 62
    try:
        gate.open("g-room")
        until(client, batch.id, lambda b: b.status == "finalizing" and b.request_counts.completed == 3)
    finally:
        files.min_free = live.settings.batch_min_free_disk  # room again, no restart
    done = final(client, batch.id)
    assert done.status == "completed"
    exactly_once(client, done, "r", 3)


def test_a_stored_line_over_the_body_limit_is_answered_413_unparsed(live):
    raw = emb_line("big", "g-open", "x" * 200)
    runner = live.runner.app[BATCHES_KEY]
    pinned: list[str] = []

    async def pin(model: str) -> None:
        pinned.append(model)

    live.settings.max_body_bytes = 100  # lowered after the line was accepted
    try:
        outcome = live.call(run_line(raw, "/v1/embeddings", runner.env, pin))
    finally:
        live.settings.max_body_bytes = 8 * 1024 * 1024
    assert outcome.status == 413 and "max_body_bytes" in outcome.body["error"]["message"]
    assert not pinned  # refused before the body was parsed, let alone a model used


def test_a_full_database_sets_the_batch_back_and_the_runner_keeps_running(live, gate, caplog):
    client = client_of(live)
    store = live.runner.app[BATCHES_KEY].store
    # Answers of 3,000 floats need new database pages; SQLite refusing to grow is a real full disk to it.
    batch = submit(client, "g-sqlite", 3, "s", dimensions=3000)
    until(client, batch.id, lambda b: b.status == "in_progress")
    with store._lock:
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages}")
    gate.release("g-sqlite", 3)
    until(client, batch.id, lambda b: any(batch.id in r.getMessage() and "database or disk is full" in r.getMessage()
                                           for r in caplog.records if r.levelno >= logging.ERROR))
    with store._lock:
        store._db.execute("PRAGMA max_page_count = 1073741823")
    assert client.batches.retrieve(batch.id).status == "in_progress"  # set back, not failed

    other = submit(client, "g-open", 2, "o")  # the runner is alive: another batch runs meanwhile
    gate.open("g-open")
    assert final(client, other.id).status == "completed"

    gate.release("g-sqlite", 3)  # its unrecorded lines run again once the batch is tried again
    done = final(client, batch.id)
    assert done.status == "completed"
    out, _ = exactly_once(client, done, "s", 3, dims=3000)
    assert len(out) == 3


def test_a_batch_on_a_down_upstream_does_not_hold_a_later_batch(live, gate):
    client = client_of(live)
    stuck = submit(client, "down-model", 2, "w")
    later = submit(client, "g-open", 3, "l")
    gate.open("g-open")
    done = final(client, later.id)
    assert done.status == "completed"
    exactly_once(client, done, "l", 3)
    waiting = client.batches.retrieve(stuck.id)
    assert waiting.status == "in_progress" and waiting.request_counts.completed == 0  # its lines wait, not fail
    client.batches.cancel(stuck.id)
    gone = final(client, stuck.id)
    assert gone.status == "cancelled"
    _, errors = exactly_once(client, gone, "w", 2)
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
