"""Bad requests get the right status and OpenAI's error shape (Ollama's on /api/), never a crash or
a leaked path, and the server keeps serving afterwards."""

from __future__ import annotations

import json

import pytest

from server_harness import MODEL, LiveServer, install_model, server_settings

pytestmark = pytest.mark.model
CHAT = "/v1/chat/completions"
OK_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    settings = server_settings(tmp_path_factory.mktemp("home"), max_body_bytes=64 * 1024, context_length=256)
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        yield live


def assert_openai_error(body: dict, param=None, code=None, error_type="invalid_request_error"):
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == error_type and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    text = json.dumps(body)
    assert "Traceback" not in text and "/work/" not in text and "/tmp/" not in text and ".gguf" not in text


@pytest.mark.parametrize("change, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 100}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"seed": "x"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}, 5]}, "messages[1]"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"priority": "vip"}, "priority"),
    ({"model": 42}, "model"),
    ({"presence_penalty": 3}, "presence_penalty"),
])
def test_bad_fields(server, change, param):
    status, body = server.json("POST", CHAT, {**OK_BODY, **change})
    assert status == 400, body
    assert_openai_error(body, param=param)


def test_malformed_bodies(server):
    for raw in [b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'"text"', b"{" * 100000]:
        status, _, data = server.request("POST", CHAT, raw=raw)
        assert status in (400, 413), raw[:10]
        assert_openai_error(json.loads(data))


def test_body_too_large(server):
    big = {**OK_BODY, "messages": [{"role": "user", "content": "x" * 100_000}]}
    status, body = server.json("POST", CHAT, big)
    assert status == 413
    assert_openai_error(body, code="request_too_large")


def test_unknown_model(server):
    status, body = server.json("POST", CHAT, {**OK_BODY, "model": "no-such-model"})
    assert status == 404
    assert_openai_error(body, param="model", code="model_not_found")
    status, body = server.json("POST", "/v1/embeddings", {"model": "no-such-model:q4", "input": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_prompt_longer_than_context(server):
    long = {**OK_BODY, "messages": [{"role": "user", "content": "hello " * 400}]}  # context is 256 tokens
    status, body = server.json("POST", CHAT, long)
    assert status == 400
    assert_openai_error(body, code="context_length_exceeded")
    status, body = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "hello " * 400})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "prompt"
    status, body = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": "hello " * 400})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_bad_token_ids(server):
    status, body = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": [1, -4, 10**9]})
    assert status == 400 and body["error"]["param"] == "prompt"


def test_unknown_route_and_wrong_method(server):
    status, body = server.json("GET", "/v1/nothing-here")
    assert status == 404
    assert_openai_error(body, code="not_found")
    status, headers, data = server.request("GET", CHAT)
    assert status == 405 and "POST" in headers.get("Allow", "")
    assert_openai_error(json.loads(data), code="method_not_allowed")


def test_ollama_error_shape(server):
    for method, path, body, expected in [
        ("POST", "/api/generate", {"model": "no-such-model", "prompt": "x"}, 404),
        ("POST", "/api/chat", {"model": MODEL, "messages": "x"}, 400),
        ("POST", "/api/generate", {"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}, 400),
        ("POST", "/api/show", {}, 400),
        ("GET", "/api/nothing", None, 404),
    ]:
        status, data = server.json(method, path, body)
        assert status == expected, (path, data)
        assert set(data) == {"error"} and isinstance(data["error"], str) and data["error"]


def test_still_serving_after_all_that(server):
    status, body = server.json("POST", CHAT, OK_BODY)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert server.json("GET", "/health")[0] == 200


def test_shutting_down_answers_503_with_retry_after(smollm2_gguf, tmp_path):
    settings = server_settings(tmp_path / "home")
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        live.call(live.manager.close())  # what the daemon's shutdown does before the socket closes
        status, headers, data = live.request("POST", CHAT, OK_BODY)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert_openai_error(json.loads(data), code="overloaded", error_type="server_error")
        status, body = live.json("POST", "/api/generate", {"model": MODEL, "prompt": "x"})
        assert status == 503 and isinstance(body["error"], str)
