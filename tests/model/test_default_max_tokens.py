"""The setting default_max_tokens: the answer's length where a request names no limit, in every
dialect that leaves the limit open (OpenAI chat, Responses, Ollama, llama.cpp's native endpoints),
while a limit the request names still wins, larger or smaller. On the real model, greedy, through
a real server."""

from __future__ import annotations

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
DEFAULT = 6
COUNT = "Count from 1 to 100, one number per line."  # SmolLM2 answers far past 6 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, default_max_tokens=DEFAULT) as live:
        yield live


def chat(server, **extra) -> dict:
    status, body = server.json("POST", "/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": COUNT}], **extra})
    assert status == 200, body
    return body


def test_openai_chat_without_a_limit_gets_the_default_and_a_named_one_wins(server) -> None:
    plain = chat(server)
    assert plain["usage"]["completion_tokens"] == DEFAULT
    assert plain["choices"][0]["finish_reason"] == "length"
    assert chat(server, max_tokens=DEFAULT + 3)["usage"]["completion_tokens"] == DEFAULT + 3
    assert chat(server, max_completion_tokens=2)["usage"]["completion_tokens"] == 2


def test_responses_without_max_output_tokens_end_incomplete_at_the_default(server) -> None:
    status, body = server.json("POST", "/v1/responses", {"model": MODEL, "temperature": 0, "input": COUNT})
    assert status == 200, body
    assert body["usage"]["output_tokens"] == DEFAULT
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["max_output_tokens"] is None  # the request's own field, echoed as it came


@pytest.mark.parametrize("options", [{}, {"num_predict": -1}], ids=["absent", "minus-one"])
def test_ollama_num_predict_absent_or_unlimited_gets_the_default(server, options) -> None:
    status, body = server.json("POST", "/api/chat", {
        "model": MODEL, "stream": False, "messages": [{"role": "user", "content": COUNT}],
        "options": {"temperature": 0, **options}})
    assert status == 200, body
    assert body["eval_count"] == DEFAULT and body["done_reason"] == "length"
    status, body = server.json("POST", "/api/generate", {
        "model": MODEL, "stream": False, "prompt": COUNT, "options": {"temperature": 0, "num_predict": DEFAULT + 2}})
    assert status == 200, body
    assert body["eval_count"] == DEFAULT + 2


def test_llamacpp_completion_and_props_follow_the_default(server) -> None:
    for n_predict in ({}, {"n_predict": -1}):
        status, body = server.json("POST", "/completion", {"model": MODEL, "prompt": "1, 2, 3, 4,", "temperature": 0,
                                                           **n_predict})
        assert status == 200, body
        assert body["tokens_predicted"] == DEFAULT and body["stop_type"] == "limit"
    status, body = server.json("POST", "/completion", {"model": MODEL, "prompt": "1, 2, 3, 4,", "temperature": 0,
                                                       "n_predict": DEFAULT + 4})
    assert body["tokens_predicted"] == DEFAULT + 4
    status, props = server.json("GET", "/props")
    assert status == 200 and props["default_generation_settings"]["params"]["n_predict"] == DEFAULT
