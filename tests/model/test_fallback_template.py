"""A model whose GGUF has no chat template is served with ChatML (api/templates.py), and the
fallback's markers end its answer (issue 47 item 4). Gemma 3 270M base is such a model: it writes
`<|im_end|>` as plain text, and before this ran every answer to max_tokens (measured: 300 of 300
tokens on each of three questions, the markers repeated in the text). In each dialect the answer
now stops at the marker, which is not shown."""

from __future__ import annotations

import pytest

from server_harness import MODEL, LiveServer, model_server

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LIMIT = 120  # far above the answer (12 tokens measured), far below what a runaway answer takes


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma3_gguf) -> LiveServer:
    with model_server(tmp_path_factory.mktemp("home"), gemma3_gguf, context_length=1024) as live:
        yield live


def test_openai_chat_stops_at_the_fallbacks_marker(server: LiveServer) -> None:
    status, body = server.json("POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                                                                "max_tokens": LIMIT, "temperature": 0}, timeout=300)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < LIMIT, body
    assert "<|im_" not in body["choices"][0]["message"]["content"]


def test_ollama_chat_and_generate_stop_at_the_fallbacks_marker(server: LiveServer) -> None:
    for path, extra in (("/api/chat", {"messages": QUESTION}), ("/api/generate", {"prompt": QUESTION[0]["content"]})):
        status, body = server.json("POST", path, {"model": MODEL, "stream": False, **extra,
                                                  "options": {"num_predict": LIMIT, "temperature": 0}}, timeout=300)
        assert status == 200, body
        assert body["done_reason"] == "stop" and body["eval_count"] < LIMIT, (path, body)
        text = body["message"]["content"] if path == "/api/chat" else body["response"]
        assert "<|im_" not in text


def test_anthropic_ends_its_turn_at_the_fallbacks_marker(server: LiveServer) -> None:
    status, body = server.json("POST", "/v1/messages", {"model": MODEL, "messages": QUESTION, "max_tokens": LIMIT,
                                                        "temperature": 0}, timeout=300)
    assert status == 200, body
    # The template's own stop is the end of a turn, not one of the client's stop_sequences.
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None, body
    assert body["usage"]["output_tokens"] < LIMIT and "<|im_" not in body["content"][0]["text"]
