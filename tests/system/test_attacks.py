"""The real daemon against hostile or broken requests (issue 9): each one gets its documented 4xx
quickly, the daemon keeps its pid, /health stays fast during the attack, and a greedy chat after
all of them answers exactly as it did before.

Every input here once killed (SIGSEGV), stalled or 500'd the daemon; the bodies are sent as raw
bytes, since some of them cannot be produced by `json.dumps` (a 5,000-digit integer parses
fine in the client but not without limits in the server; 600 nested schemas overflow the client's
own recursion limit).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from daemon_util import attacked_daemon, free_port

pytestmark = pytest.mark.model

HEALTH_BUDGET_S = 0.1  # the bound for /health while an attack is in flight
ANSWER_BUDGET_S = 1.0  # each attack's 4xx


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[tuple[str, int]]:
    with attacked_daemon(tmp_path_factory.mktemp("attacks"), smollm2_gguf) as (info, proc):
        yield info["url"], proc.pid


def _split(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def post_raw(url: str, path: str, body: bytes, timeout: float = 30) -> tuple[int, bytes, float]:
    conn = http.client.HTTPConnection(*_split(url), timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - t0
    finally:
        conn.close()


class HealthProbe:
    """Polls /health on one keep-alive connection while an attack runs; keeps the latencies."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(*_split(self.url), timeout=10)
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                conn.request("GET", "/health")
                resp = conn.getresponse()
                resp.read()
                self.latencies.append(time.monotonic() - t0)
                assert resp.status == 200
                self._stop.wait(0.02)
        finally:
            conn.close()

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def greedy_chat(url: str) -> str:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 16, "temperature": 0}
    status, raw, _ = post_raw(url, "/v1/chat/completions", json.dumps(body).encode(), timeout=120)
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["message"]["content"]


def chat_body(**extra: object) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def message_body(**extra: object) -> dict:
    return {"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


def responses_body(**extra: object) -> dict:
    return {"model": "smol", "input": "hi", "max_output_tokens": 4, **extra}


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def forced_tool(parameters: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


def deep_schema_text(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def _json(obj: dict) -> bytes:
    return json.dumps(obj).encode()


# (name, path, raw body, expected status)
ATTACKS: list[tuple[str, str, bytes, int]] = [
    ("string maxLength 1e6", "/v1/chat/completions",
     _json(chat_body(**schema_format({"type": "string", "maxLength": 1_000_000}))), 400),
    ("forced tool maxItems 1e6", "/v1/chat/completions",
     _json(chat_body(**forced_tool({"type": "object", "properties": {
         "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}}}))), 400),
    ("ollama format maxLength 1e6", "/api/chat",
     _json({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "format": {"type": "string", "maxLength": 1_000_000}}), 400),
    ("array minItems 4e6", "/v1/chat/completions",
     _json(chat_body(**schema_format({"type": "array", "items": {"type": "integer"}, "minItems": 4_000_000}))), 400),
    ("schema nested 600 deep", "/v1/chat/completions",
     b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
     b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
     + deep_schema_text(600).encode() + b"}}}", 400),
    ("5,000-digit integer (OpenAI)", "/v1/chat/completions",
     b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("5,000-digit integer (Ollama)", "/api/chat",
     b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": '
     + b"9" * 5000 + b"}}", 400),
    # The Responses API takes the chat path: the same bounds, named by its own fields.
    ("Responses text.format maxLength 1e6", "/v1/responses",
     _json(responses_body(text={"format": {"type": "json_schema", "name": "x",
                                           "schema": {"type": "string", "maxLength": 1_000_000}}})), 400),
    ("Responses forced tool maxItems 1e6", "/v1/responses",
     _json(responses_body(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
         "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}}}}],
         tool_choice={"type": "function", "name": "f"})), 400),
    ("Responses schema nested 600 deep", "/v1/responses",
     b'{"model": "smol", "input": "hi", "max_output_tokens": 4, "text": {"format": {"type": "json_schema", '
     b'"name": "x", "schema": ' + deep_schema_text(600).encode() + b"}}}", 400),
    ("5,000-digit integer (Responses)", "/v1/responses",
     b'{"model": "smol", "input": "hi", "max_output_tokens": ' + b"9" * 5000 + b"}", 400),
    ("Responses input of 5,000 items", "/v1/responses",
     _json(responses_body(input=[{"role": "user", "content": "x"}] * 5000)), 400),
    ("embeddings past max_embed_tokens", "/v1/embeddings",
     _json({"model": "smol", "input": [" ".join(["word"] * 2000)] * 200}), 400),
    ("rerank of 5,000 documents (past max_rerank_documents)", "/v1/rerank",
     _json({"model": "smol", "query": "q", "documents": ["word"] * 5000}), 400),
    ("rerank on a model that is not a reranker", "/rerank",
     _json({"model": "smol", "query": "q", "documents": ["a", "b"]}), 400),
    # Anthropic's Messages route: the same bounds on its own field names.
    ("messages: forced tool maxItems 1e6", "/v1/messages",
     _json(message_body(tools=[{"name": "f", "input_schema": {"type": "object", "properties": {
         "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}}}}],
         tool_choice={"type": "tool", "name": "f"})), 400),
    ("messages: output schema maxLength 1e6", "/v1/messages",
     _json(message_body(output_config={"format": {"type": "json_schema",
                                                  "schema": {"type": "string", "maxLength": 1_000_000}}})), 400),
    ("messages: input_schema nested 600 deep", "/v1/messages",
     b'{"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
     b'"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": ' + deep_schema_text(600).encode()
     + b"}]}", 400),
    ("messages: 5,000-digit max_tokens", "/v1/messages",
     b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("messages: 5,000 content blocks", "/v1/messages",
     _json(message_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}] * 5000}])), 400),
]


def assert_clean(raw: bytes) -> None:
    text = raw.decode("utf-8", "replace")
    assert "Traceback" not in text and "/work/" not in text and "site-packages" not in text, text
    assert "/home/" not in text and "/tmp/" not in text, text


def test_every_attack_gets_its_4xx_and_the_daemon_lives(daemon: tuple[str, int]) -> None:
    url, pid = daemon
    before = greedy_chat(url)  # also loads the model, so no attack below waits for a load
    for name, path, body, expected in ATTACKS:
        with HealthProbe(url) as probe:
            status, raw, took = post_raw(url, path, body)
            time.sleep(0.1)  # let the probe see the daemon just after the answer too
        assert status == expected, (name, status, raw[:300])
        assert took < ANSWER_BUDGET_S, (name, took)
        assert_clean(raw)
        assert probe.latencies and max(probe.latencies) < HEALTH_BUDGET_S, (name, max(probe.latencies, default=None))
        assert json.loads(_get(url, "/health"))["status"] == "ok", name
    assert greedy_chat(url) == before


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_declared_terabyte_body_is_refused_before_reading(daemon: tuple[str, int], path: str) -> None:
    url, _ = daemon
    with socket.create_connection(_split(url), timeout=5) as sock:
        t0 = time.monotonic()
        sock.sendall(f"POST {path} HTTP/1.1\r\n".encode() + b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n{")
        head = sock.recv(4096)
        took = time.monotonic() - t0
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert took < ANSWER_BUDGET_S, took
    assert_clean(head)


def test_pull_of_a_local_http_url_is_refused_without_port_details(daemon: tuple[str, int]) -> None:
    url, _ = daemon
    closed_port = free_port()  # nothing listens here
    body = _json({"model": f"http://127.0.0.1:{closed_port}/x.gguf", "stream": False})
    status, raw, took = post_raw(url, "/api/pull", body)
    assert status == 400, raw
    assert took < ANSWER_BUDGET_S
    text = raw.decode().lower()
    # Refused by policy before any connection: nothing says whether that port is open.
    assert "connect" not in text and "errno" not in text and "refused" not in text, text
    assert_clean(raw)


def _get(url: str, path: str) -> bytes:
    conn = http.client.HTTPConnection(*_split(url), timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()
