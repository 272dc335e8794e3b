"""A bug after a stream's 200 ends every dialect's stream with its own error frame (server/streamed.py).

Once the headers are out the error middleware cannot answer, so each dialect's route hands the one
helper a way to send an error frame. A non-Localserve exception there (a bug: here one injected
into the helper's guard, after the real model's frames were written) must end the stream in the
dialect's own shape, say only "internal server error" (no exception text, no path), and leave the
server serving. Before the helper, `/infill` and `/completion` had no such branch at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model

SECRET = "bug text naming /home/someone/secret.txt"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf) as live:
        yield live


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith(b"data: ") and line != b"data: [DONE]"]


def ndjson(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


OPENAI_INTERNAL = {"error": {"message": "internal server error", "type": "server_error", "param": None,
                             "code": "internal_error"}}

# path, body, how the answer splits into frames, what its frames must end with
CASES: dict[str, tuple[str, dict[str, Any], Callable[[bytes], list[dict]], Callable[[list[dict]], bool]]] = {
    "openai": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True},
               sse_data, lambda frames: frames[-1] == OPENAI_INTERNAL),
    "anthropic": ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True},
                  sse_data, lambda frames: frames[-1] == {"type": "error", "error": {
                      "type": "api_error", "message": "internal server error"}}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Say hi.", "max_output_tokens": 3, "stream": True},
                  sse_data, lambda frames: frames[-1]["type"] == "response.failed"
                  and frames[-1]["response"]["error"] == {"code": "internal_error", "message": "internal server error"}),
    # The error line, then a done line with its reason for readers that wait for `done`.
    "ollama": ("/api/chat", {"model": MODEL, "messages": CHAT, "options": {"num_predict": 3}},
               ndjson, lambda frames: frames[-2] == {"error": "internal server error"}
               and frames[-1]["done"] is True and frames[-1]["done_reason"] == "error"),
    "llama.cpp": ("/completion", {"model": MODEL, "prompt": "Hello", "n_predict": 3, "stream": True},
                  sse_data, lambda frames: frames[-1] == OPENAI_INTERNAL),
}


@pytest.mark.parametrize("dialect", CASES)
def test_a_bug_mid_stream_ends_it_in_the_dialects_own_shape(server, monkeypatch, caplog, dialect: str) -> None:
    import localserve.server.streamed as streamed

    real_guard = streamed.guard_disconnect

    async def guard_then_fail(request, work, claim=None):
        await real_guard(request, work, claim)  # the real answer's frames go out first
        raise RuntimeError(SECRET)

    monkeypatch.setattr(streamed, "guard_disconnect", guard_then_fail)
    path, body, frames_of, is_internal_error = CASES[dialect]
    status, _, raw = server.request("POST", path, body)
    assert status == 200  # the headers were out before the failure
    frames = frames_of(raw)
    assert len(frames) >= 2, raw  # the answer's own frames, then the error
    assert is_internal_error(frames), frames[-2:]
    assert b"secret" not in raw and b"RuntimeError" not in raw
    assert SECRET in caplog.text  # the traceback went to the log instead

    monkeypatch.undo()
    status, _, raw = server.request("POST", path, body)
    assert status == 200 and not is_internal_error(frames_of(raw))  # the server serves on
