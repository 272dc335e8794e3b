"""Two real models (SmolLM2-135M and Gemma-3 270M) on a server with room for one: requests for the
model that is not loaded wait their turn and get full answers, swaps alternate no faster than the
thrash guard, an interactive request outranks a batch of the other model (whose lines each run
once), a lane full of waiting requests is a 429 with Retry-After; and with room for both, no swap.

Every answer is checked against the same request served on a server with room for both (greedy
decoding: exact). The official `openai` client drives the server as a user's program would.
"""

from __future__ import annotations

import io
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import openai
import pytest

from localserve.store.cache import ModelStore
from server_harness import LiveServer, server_settings
from test_batches import by_id, contents, line, submit, wait

pytestmark = pytest.mark.model

SMOL = "smollm2-135m:Q4_1"
GEMMA = "gemma3-270m:Q4_K_M"
MODELS = (SMOL, GEMMA)
GUARD_S = 2.0  # the thrash guard in these tests: short, so a test sees several swaps in seconds
LIMITS = dict(context_length=512, max_sequences=4)
MANAGER_LOG = "localserve.runtime.manager"


@pytest.fixture(scope="module")
def home(tmp_path_factory, smollm2_gguf: Path, gemma3_gguf: Path) -> Path:
    """A home holding both real models, registered in place."""
    home = tmp_path_factory.mktemp("swaps")
    store = ModelStore(server_settings(home))
    for ref, path in ((SMOL, smollm2_gguf), (GEMMA, gemma3_gguf)):
        name, tag = ref.split(":")
        store.register_local(path, name, tag)
    return home


def serve(home: Path, **changes: Any) -> LiveServer:
    return LiveServer(server_settings(home, **{**LIMITS, **changes}))


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def chat_body(i: int, max_tokens: int = 24) -> dict[str, Any]:
    return {"model": MODELS[i % 2], "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Write a short line about the number {i}."}]}


def stream_chat(client: openai.OpenAI, body: dict[str, Any], marks: dict[str, float] | None = None) -> str:
    """A streamed chat's whole text; `marks` gets the time of its first token."""
    parts = []
    for chunk in client.chat.completions.create(stream=True, **body):
        if chunk.choices and chunk.choices[0].delta.content:
            if marks is not None and "first_token" not in marks:
                marks["first_token"] = time.monotonic()
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def alone(client: openai.OpenAI, body: dict[str, Any]) -> str:
    return client.chat.completions.create(**body).choices[0].message.content or ""


def loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m.group(1) for r in caplog.records if r.name == MANAGER_LOG
            and (m := re.match(r"loaded (\S+) in", r.getMessage()))]


def unloads(caplog: pytest.LogCaptureFixture) -> list[tuple[str, float, str]]:
    """(model, seconds resident, why) of every swap unload the log shows."""
    out = []
    for r in caplog.records:
        m = re.match(r"swap: unloading (\S+) \(resident ([\d.]+)s, (\w+)", r.getMessage())
        if r.name == MANAGER_LOG and m:
            out.append((m.group(1), float(m.group(2)), m.group(3)))
    return out


@pytest.fixture(scope="module")
def reference(home: Path) -> dict[str, str]:
    """Answers of the test prompts with room for both models: every prompt alone, greedy."""
    with serve(home) as live:
        client = client_of(live)
        answers = {f"chat-{i}": alone(client, chat_body(i)) for i in range(8)}
        answers.update({f"batch-{i}": alone(client, batch_body(i)) for i in range(BATCH_LINES)})
        answers["interactive"] = alone(client, chat_body(1, max_tokens=16))
    assert all(answers.values())
    return answers


def test_room_for_both_loads_each_once_and_never_swaps(home: Path, reference, caplog) -> None:
    caplog.set_level(logging.INFO, logger=MANAGER_LOG)
    with serve(home) as live:  # max_loaded_models unset: the memory estimates say both fit
        client = client_of(live)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: stream_chat(client, chat_body(i)), range(8)))
        status, ps = live.json("GET", "/api/ps")
    assert answers == [reference[f"chat-{i}"] for i in range(8)]
    assert sorted(loads(caplog)) == sorted(MODELS)
    assert unloads(caplog) == []
    assert status == 200 and sorted(m["name"] for m in ps["models"]) == sorted(MODELS)


def test_one_slot_eight_chats_all_finish_and_swaps_respect_the_guard(home: Path, reference, caplog) -> None:
    """8 clients at once, alternating between the models, each sending two chats in a row."""
    caplog.set_level(logging.INFO, logger=MANAGER_LOG)
    with serve(home, max_loaded_models=1, swap_min_residency=GUARD_S) as live:
        client = client_of(live)

        def two_turns(i: int) -> list[str]:
            return [stream_chat(client, chat_body(i)) for _ in range(2)]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(two_turns, range(8)))
    assert answers == [[reference[f"chat-{i}"]] * 2 for i in range(8)]  # full answers, none refused
    order = loads(caplog)
    assert len(order) >= 2 and all(a != b for a, b in zip(order, order[1:])), order  # loads alternate
    for model, resident, why in unloads(caplog):
        # A model with work keeps its slot for the guard; only an idle one gives it up sooner.
        assert why == "idle" or resident >= GUARD_S, (model, resident, why)
    waits = [r.getMessage() for r in caplog.records if "first request after its load waited" in r.getMessage()]
    assert len(waits) == len(order)


BATCH_LINES = 12


def batch_body(i: int) -> dict[str, Any]:
    return {"model": SMOL, "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": f"Tell a story about a cat named {i}."}]}


def test_interactive_request_outranks_a_batch_of_the_other_model(home: Path, reference, caplog) -> None:
    """A batch runs on SmolLM2; a streamed (interactive) chat for Gemma gets its first token while
    the batch is still running (its lines are ended at a step boundary), and the batch then
    finishes with every custom_id exactly once, each answer the one the line gets alone."""
    caplog.set_level(logging.INFO, logger=MANAGER_LOG)
    with serve(home, max_loaded_models=1, swap_min_residency=60.0) as live:  # the guard does not apply
        client = client_of(live)
        batch = submit(client, [line(f"batch-{i}", "/v1/chat/completions", batch_body(i))
                                for i in range(BATCH_LINES)], "/v1/chat/completions")
        deadline = time.monotonic() + 120
        while not any(m.get("running") for m in live.json("GET", "/api/ps")[1]["models"]):
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.05)
        marks: dict[str, float] = {}
        answer = stream_chat(client, chat_body(1, max_tokens=16), marks)
        during = client.batches.retrieve(batch.id)
        done = wait(client, batch.id)
        out = by_id(contents(client, done.output_file_id))  # asserts no custom_id twice
    assert answer == reference["interactive"]
    assert during.status == "in_progress" and during.request_counts.completed < BATCH_LINES
    assert done.status == "completed" and done.error_file_id is None
    assert sorted(out) == sorted(f"batch-{i}" for i in range(BATCH_LINES))
    for cid, item in out.items():
        assert item["response"]["status_code"] == 200
        assert item["response"]["body"]["choices"][0]["message"]["content"] == reference[cid]
    preempted = [r for r in caplog.records if "batch-lane requests of" in r.getMessage()]
    assert preempted, "the swap should have ended the batch's running lines"
    assert loads(caplog)[:3] == [SMOL, GEMMA, SMOL]


def test_a_full_lane_of_waiting_requests_is_429_and_ps_says_why(home: Path, reference) -> None:
    """SmolLM2 busy and guarded; Gemma's interactive lane holds queue_size=2 waiting requests:
    the third is a 429 with Retry-After. /api/ps, the dashboard state and `localserve ps` show the
    waiting requests and which model must drain; when SmolLM2's chat ends, both waiting chats run."""
    from localserve.commands.daemon import _print_ps

    with serve(home, max_loaded_models=1, swap_min_residency=600.0, queue_size=2) as live:
        client = client_of(live)
        busy = client.chat.completions.create(stream=True, model=SMOL, max_tokens=400, temperature=0,
                                              messages=[{"role": "user", "content": "Tell a very long story."}])
        next(iter(busy))  # SmolLM2 is loaded and streaming
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(stream_chat, client, chat_body(1)) for _ in range(2)]
            deadline = time.monotonic() + 60
            while True:
                row = next((m for m in live.json("GET", "/api/ps")[1]["models"] if m["name"] == GEMMA), None)
                if row is not None and row["waiting"].get("interactive") == 2:
                    break
                assert time.monotonic() < deadline, "the two chats never queued"
                time.sleep(0.05)
            with pytest.raises(openai.RateLimitError) as err:
                stream_chat(client, chat_body(1))
            assert int(err.value.response.headers["Retry-After"]) >= 1
            assert "full" in str(err.value)
            assert row["state"] == "waiting" and row["waiting_for_load"] == 2
            assert SMOL in row["reason"] and "minimum residency" in row["reason"]
            dashboard = live.json("GET", "/api/dashboard/state")[1]
            [gemma] = [m for m in dashboard["models"] if m["name"] == GEMMA]
            assert gemma["state"] == "waiting" and SMOL in gemma["reason"] and gemma["waiting_for_load"] == 2
            printed = io.StringIO()
            with redirect_stdout(printed):
                _print_ps(live.json("GET", "/api/ps")[1]["models"])
            assert re.search(rf"{re.escape(GEMMA)}\s.*waiting", printed.getvalue()), printed.getvalue()
            assert f"{SMOL} must drain" in printed.getvalue()
            assert not any(f.done() for f in waiting)
            busy.close()  # SmolLM2 idle: it gives its slot up at once, guard or not
            answers = [f.result(timeout=120) for f in waiting]
    assert answers == [reference["chat-1"]] * 2
