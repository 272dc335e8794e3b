"""The coding agents' real first requests (tests/fixtures/agents, recorded from the npm packages),
replayed against the real server and model: every field and tool shape an agent sends must be
accepted, in its own dialect. The long texts (system prompts, tool descriptions) are shortened to
fit SmolLM2's context; everything else is sent as recorded, except `stream`, so the answer is
one object to read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
TEXT_KEYS = {"text", "description", "content", "instructions"}


def shortened(value: Any, limit: int = 160) -> Any:
    """The recorded body with every long text cut to `limit` characters and long lists of tools
    cut to a few: the shapes stay, the tokens fit."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in TEXT_KEYS and isinstance(item, str):
                out[key] = item[:limit]
            elif key == "tools" and isinstance(item, list):
                out[key] = [shortened(t, limit) for t in item[:4]] + [shortened(t, limit) for t in item
                                                                       if t.get("type") not in (None, "function")]
            elif key == "properties" and isinstance(item, dict):
                out[key] = {k: shortened(v, limit) for k, v in list(item.items())[:3]}
            elif key == "required" and isinstance(item, list):
                out[key] = []
            else:
                out[key] = shortened(item, limit)
        return out
    if isinstance(value, list):
        return [shortened(v, limit) for v in value]
    return value


def recorded(name: str) -> dict:
    body = shortened(json.loads((FIXTURES / name).read_text()))
    body["model"] = MODEL
    body["stream"] = False
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, context_length=8192) as live:
        yield live


def test_claude_codes_request_is_answered(server) -> None:
    body = recorded("claude-code-2.1.197-messages.json")
    body["max_tokens"] = 16  # recorded: 32000, more than SmolLM2's context; Claude Code's own is 200k
    assert body["thinking"] == {"type": "adaptive"} and "context_management" in body and "output_config" in body
    status, out = server.json("POST", "/v1/messages?beta=true", body,
                              headers={"anthropic-version": "2023-06-01", "Content-Type": "application/json"})
    assert status == 200, out
    assert out["type"] == "message" and out["content"] and out["usage"]["input_tokens"] > 0


def test_claude_codes_max_tokens_beyond_the_context_is_cut_to_fit(server) -> None:
    body = recorded("claude-code-2.1.197-messages.json")
    assert body["max_tokens"] == 32000
    # Greedy, and stopped at the first space, newline or period: what is checked is that 32000 is
    # accepted, not a sampled answer that may run to the end of the context (it did once in CI,
    # past the client's 120 s, when the recorded request sampled at its default temperature).
    body["temperature"] = 0
    body["stop_sequences"] = ["\n", " ", "."]
    status, out = server.json("POST", "/v1/messages?beta=true", body,
                              headers={"anthropic-version": "2023-06-01", "Content-Type": "application/json"})
    assert status == 200, out


def test_copilots_request_is_answered(server) -> None:
    body = recorded("copilot-1.0.102-chat-completions.json")
    body["max_tokens"] = 16
    body.pop("stream_options", None)  # only valid with stream
    status, out = server.json("POST", "/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]


def test_codexs_request_is_answered(server) -> None:
    body = recorded("codex-0.171.0-responses.json")
    types = {t["type"] for t in body["tools"]}
    assert {"function", "namespace", "web_search"} <= types
    body["max_output_tokens"] = 16
    status, out = server.json("POST", "/v1/responses", body)
    assert status == 200, out
    assert out["object"] == "response" and out["status"] in ("completed", "incomplete")
