"""One error channel: an engine's typed failure reaches every answer shape alike (issue 22, step 7).

Real server, real model. A request whose JSON schema and logit_bias together leave no token to
sample fails inside the engine, after the 200 of a stream was sent; it must be the same 400 body
non-streamed, in the stream's error frame, and in a batch line's error. A request the server ends
(the model shut down under it) says it was cancelled instead of answering 200 with what it had."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf) as live:
        yield live


@pytest.fixture(scope="module")
def banned(smollm2_gguf: Path) -> dict[str, int]:
    """logit_bias that bans every token a JSON object can start with."""
    from localserve.backends.llamacpp.backend import LlamaCppBackend

    with LlamaCppBackend.load(smollm2_gguf, n_ctx=256, n_seq_max=1, n_batch=64) as backend:
        return {str(t): -100 for t in range(backend.n_vocab)
                if backend.token_to_bytes(t).lstrip().startswith(b"{") or not backend.token_to_bytes(t).strip()}


def dead_end(banned: dict[str, int], **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Give me a JSON object."}],
            "max_tokens": 16, "temperature": 0, "logit_bias": banned,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}, **extra}


def sse_events(data: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in data.splitlines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def test_a_schema_dead_end_is_the_same_400_streamed_and_not(server, banned) -> None:
    status, body = server.json("POST", "/v1/chat/completions", dead_end(banned))
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and "no token" in error["message"]

    # Streamed, nothing was sent before the engine met the dead end (server/held.py holds the 200
    # and the role chunk): the same 400, as a status every client reads (issue 47).
    status, _, data = server.request("POST", "/v1/chat/completions", dead_end(banned, stream=True))
    assert status == 400, data
    assert json.loads(data) == {"error": error}


def test_the_dead_end_in_a_batch_line_is_that_400_too(server, banned) -> None:
    line = json.dumps({"custom_id": "dead", "method": "POST", "url": "/v1/chat/completions",
                       "body": dead_end(banned)}).encode()
    boundary = "b0undary"
    upload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
              f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
              "Content-Type: application/jsonl\r\n\r\n").encode() + line + f"\r\n--{boundary}--\r\n".encode()
    status, _, raw = server.request("POST", "/v1/files", raw=upload,
                                    headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, raw
    file_id = json.loads(raw)["id"]
    status, batch = server.json("POST", "/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                         "completion_window": "24h"})
    assert status == 200, batch
    deadline = time.monotonic() + 120
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        _, batch = server.json("GET", f"/v1/batches/{batch['id']}")
    assert batch["status"] == "completed" and batch["error_file_id"], batch
    _, _, errors = server.request("GET", f"/v1/files/{batch['error_file_id']}/content")
    (record,) = [json.loads(x) for x in errors.splitlines()]
    assert record["custom_id"] == "dead" and record["response"]["status_code"] == 400
    direct_status, direct = server.json("POST", "/v1/chat/completions", dead_end(banned))
    assert (direct_status, direct) == (400, record["response"]["body"])


def _engine(server):
    async def get():
        async with server.manager.use(f"{MODEL}:Q4_1") as loaded:
            return loaded.engine

    return server.call(get())


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/chat"])
def test_a_request_the_server_ends_reports_cancellation(tmp_path: Path, smollm2_gguf: Path, route: str) -> None:
    with model_server(tmp_path, smollm2_gguf) as live:
        engine = _engine(live)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
                "stream": False}
        body.update({"max_tokens": 1500, "temperature": 0} if route.startswith("/v1") else
                    {"options": {"num_predict": 1500, "temperature": 0}})
        answer: list = []
        worker = threading.Thread(target=lambda: answer.append(live.json("POST", route, body)))
        worker.start()
        deadline = time.monotonic() + 60
        while engine.stats().running == 0:  # generating now
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.02)
        engine.shutdown()  # what an unload or the daemon's shutdown does to a running request
        worker.join(60)
    status, data = answer[0]
    assert status == 503, data
    message = data["error"]["message"] if route.startswith("/v1") else data["error"]
    assert "cancelled" in message
    if route.startswith("/v1"):
        assert data["error"]["code"] == "request_cancelled"
