"""Streamed answers read the way strict clients read them (real model, greedy).

llama.cpp's own server tests take a chunk's text only while its finish_reason is null; OpenAI's
shapes allow text in the finishing chunk, so a server that puts the last token there loses it for
such clients. Every stream here sends the text first and the finish_reason in a final chunk of its
own (empty text / empty delta; Ollama: `done: true` in its own object), and the text so read is
the whole non-streamed answer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from server_harness import MODEL, LiveServer, model_server

pytestmark = pytest.mark.model
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf) as live:
        yield live


def sse_chunks(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, headers, data = server.request("POST", path, {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), data
    frames = [f[len("data: "):] for f in data.decode().split("\n\n") if f.strip()]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def text_while_unfinished(chunks: list[dict[str, Any]], read: Any) -> str:
    """llama.cpp's reading: text only from choices whose finish_reason is still null."""
    return "".join(read(c["choices"][0]) for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None)


@pytest.mark.parametrize("max_tokens", [6, 48])  # a short answer cut by length, and a longer one
def test_streamed_completion_read_strictly_is_the_whole_answer(server, max_tokens):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    status, whole = server.json("POST", "/v1/completions", body)
    assert status == 200
    (choice,) = whole["choices"]
    chunks = sse_chunks(server, "/v1/completions", body)
    assert text_while_unfinished(chunks, lambda c: c["text"]) == choice["text"]
    last = chunks[-1]["choices"][0]
    assert last == {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1


def test_streamed_chat_read_strictly_is_the_whole_answer(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    status, whole = server.json("POST", "/v1/chat/completions", body)
    assert status == 200
    (choice,) = whole["choices"]
    chunks = sse_chunks(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert text_while_unfinished(chunks, lambda c: c["delta"].get("content") or "") == choice["message"]["content"]
    # The finish_reason comes in a chunk with an empty delta; then, as OpenAI documents for
    # include_usage, one chunk with no choices carries the usage.
    finishing = chunks[-2]["choices"][0]
    assert finishing["delta"] == {} and finishing["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("path, field", [("/api/generate", "response"), ("/api/chat", "message")])
def test_ollama_stream_ends_with_its_own_done_object(server, path, field):
    body: dict[str, Any] = {"model": MODEL, "options": {"temperature": 0, "num_predict": 12}}
    body.update({"prompt": PROMPT} if field == "response" else {"messages": MESSAGES})
    status, whole = server.json("POST", path, {**body, "stream": False})
    assert status == 200
    status, _, data = server.request("POST", path, body)
    assert status == 200
    lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    read = (lambda o: o["response"]) if field == "response" else (lambda o: o["message"]["content"])
    assert [o["done"] for o in lines] == [False] * (len(lines) - 1) + [True]
    assert read(lines[-1]) == ""
    assert "".join(read(o) for o in lines if not o["done"]) == read(whole)
