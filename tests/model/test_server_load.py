"""Behaviour under load, on the real model: concurrent streams give the same greedy answers as
sequential ones, a disconnecting client frees its slot, a full lane answers 429 while /health stays
up, and /metrics reports it all."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_harness import MODEL, LiveServer, install_model, server_settings

pytestmark = pytest.mark.model
PROMPTS = ["Tell me about cats.", "What is 2+2?", "Name a fruit.", "Describe the sea.", "Who wrote Hamlet?",
           "Say hello in Spanish.", "What is a star?", "Give me a color."]
# SmolLM2's end-of-generation tokens (<|endoftext|>, <|im_start|>, <|im_end|>) banned: the answer
# runs until max_tokens, so the request is still generating when the client goes away.
NO_EOS = {"0": -100, "1": -100, "2": -100}


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    # Bit-exact answers alone and together are what `speculative = "off"` promises: with drafting
    # (auto, the default) a request alone drafts and eight at once do not, and verification rows
    # round like prompt chunks, so a near-tie may go the other way (docs/architecture.md).
    settings = server_settings(tmp_path_factory.mktemp("home"), max_sequences=8, speculative="off")
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        yield live


def stream_text(client: openai.OpenAI, prompt: str, max_tokens: int = 24) -> str:
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_concurrent_streams_do_not_mix(server):
    # Each request is pinned to its own token by logit_bias, so its answer does not depend on
    # floating-point details of the batch: any difference between alone and together is a
    # stream delivered to the wrong client or a sequence mixed with another.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)

    def forced(token: int) -> str:
        parts = client.completions.create(model=MODEL, prompt=PROMPTS[token % len(PROMPTS)], max_tokens=8,
                                          temperature=0, logit_bias={str(token): 100}, stream=True)
        return "".join(p.choices[0].text for p in parts if p.choices)

    tokens = [300 + 97 * i for i in range(8)]
    alone = [forced(t) for t in tokens]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(forced, tokens))
    assert together == alone
    assert len(set(alone)) == 8


def test_eight_concurrent_streams_match_sequential(server):
    # Prompts from a few tokens to a pasted paragraph: the long ones are still prefilling in chunks
    # while the short ones decode, and all share the chat template's prefix (prefix cache hits).
    paragraph = " ".join(["The harbour town woke early, and the fishing boats left before sunrise."] * 12)
    prompts = [*PROMPTS[:5], f"Summarize: {paragraph}", f"{paragraph} What happens next?",
               f"Translate to French: {paragraph[:200]}"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    alone = [stream_text(client, p, 48) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: stream_text(client, p, 48), prompts))
    assert together == alone
    assert all(alone)


def open_stream(port: int, path: str, body: dict, wait_data: bool = True) -> tuple[socket.socket, bytes]:
    """Send a streaming request and wait for its headers and (if `wait_data`) its first data line."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while b"\r\n\r\n" not in received or (
            wait_data and b"data:" not in received and b" 200 " in received.split(b"\r\n")[0]):
        chunk = s.recv(65536)
        if not chunk:
            break
        received += chunk
    return s, received


def wait_idle(server: LiveServer, limit: float) -> float:
    """Seconds until the engine has nothing running or waiting; fails after `limit`."""
    start = time.monotonic()
    while True:
        stats = server.engine_stats()
        if stats.get("running", 1) == 0 and not any(stats.get("waiting", {}).values()):
            return time.monotonic() - start
        assert time.monotonic() - start < limit, f"still busy after {limit}s: {stats}"
        time.sleep(0.02)


def slot_deadline(server: LiveServer) -> float:
    """1 s, plus two engine steps: a cancel takes effect at the engine's next step, and on a
    crowded test machine one step of this tiny model can take a good part of a second."""
    before = server.engine_stats()["steps"]
    time.sleep(0.5)
    steps = server.engine_stats()["steps"] - before
    step_s = 0.5 / steps if steps else 0.5
    return 1.0 + 2 * step_s


def long_completion(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0, "logit_bias": NO_EOS,
            "stream": stream}


def test_disconnect_mid_stream_frees_the_slot(server):
    s, head = open_stream(server.port, "/v1/completions", long_completion(True))
    assert b" 200 " in head.split(b"\r\n")[0] and b"data:" in head
    assert server.engine_stats()["running"] == 1
    deadline = slot_deadline(server)
    s.close()
    wait_idle(server, deadline)


def test_disconnect_without_streaming_frees_the_slot(server):
    assert_silent_disconnect_frees_the_slot(server, "/v1/completions", long_completion(False))


def assert_silent_disconnect_frees_the_slot(server: LiveServer, path: str, body: dict) -> None:
    """Nothing is written to a non-streaming client until the end: the server must notice the
    closed connection by itself, and free the sequence within slot_deadline."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 30
    while server.engine_stats().get("running", 0) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    deadline = slot_deadline(server)
    s.close()
    wait_idle(server, deadline)


def test_full_lane_answers_429_and_health_stays_up(smollm2_gguf, tmp_path):
    # Keepalives every 0.2 s: a queued stream's 200 waits for its first one (server/held.py).
    settings = server_settings(tmp_path / "home", max_sequences=1, queue_size=1, sse_ping_interval=0.2)
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        running, head = open_stream(live.port, "/v1/completions", long_completion(True))
        assert b"data:" in head
        waiting, head = open_stream(live.port, "/v1/completions", {**long_completion(True), "max_tokens": 5},
                                    wait_data=False)
        assert b" 200 " in head.split(b"\r\n")[0]  # queued: headers out, tokens later
        try:
            assert live.engine_stats()["waiting"]["default"] == 1
            status, headers, data = live.request("POST", "/v1/completions", long_completion(False))
            assert status == 429
            assert int(headers["Retry-After"]) >= 1
            error = json.loads(data)["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            # Another lane still has room.
            status, body = live.json("POST", "/v1/completions", {**long_completion(False), "max_tokens": 2,
                                                                  "priority": "interactive"}, timeout=60)
            assert status == 200, body
            status, health = live.json("GET", "/health")
            assert status == 200 and health["status"] == "ok"
            status, _, metrics = live.request("GET", "/metrics")
            assert b'localserve_http_requests_total{route="/v1/completions",status="429"} 1.0' in metrics
        finally:
            running.close()
            waiting.close()
        wait_idle(live, 5.0)
        status, body = live.json("POST", "/v1/completions", {**long_completion(False), "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_metrics(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream_text(client, PROMPTS[0])
    stream_text(client, PROMPTS[0])  # the same prompt again: a prefix-cache hit
    status, headers, data = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = data.decode()
    model = f'model="{MODEL}:Q4_1"'
    for needle in [
        'localserve_http_requests_total{route="/v1/chat/completions",status="200"}',
        f"localserve_time_to_first_token_seconds_bucket{{le=\"0.5\",{model}}}",
        f"localserve_inter_token_latency_seconds_count{{{model}}}",
        f'localserve_queue_depth{{lane="interactive",{model}}} 0.0',
        f"localserve_running_sequences{{{model}}}",
        f"localserve_kv_cells_total{{{model}}}",
        f"localserve_kv_moves_total{{{model}}}",
        f"localserve_interrupted_steps_total{{{model}}} 0.0",
        f'localserve_tokens_total{{kind="completion",{model}}}',
        "localserve_models_loaded 1.0",
    ]:
        assert needle in text, needle
    hits = [line for line in text.splitlines() if line.startswith(f"localserve_prefix_cache_hit_tokens_total{{{model}}}")]
    assert hits and float(hits[0].split()[-1]) > 0
