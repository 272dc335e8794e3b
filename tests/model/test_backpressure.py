"""Backpressure: a stream whose client stops reading is dropped after settings.stream_write_timeout
and its sequence freed; a stream the engine runs too far ahead of is stopped at
engine.STREAM_BUFFER_EVENTS unread events instead of growing without end."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from fake_backend import FakeBackend
from localserve.batching.limits import EngineLimits
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.engine.local import Engine
from server_harness import MODEL, LiveServer, install_model, server_settings

BAN_EOS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens: the answer runs to max_tokens


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    # Relies on the harness's speculation off (daemon_util.SPECULATIVE): a drafted step sends
    # several tokens in one event, and SmolLM2's long story repeats itself enough that 900 tokens
    # once fit in the ~50 KB the bounded buffers hold, so the answer ended before a write blocked.
    settings = server_settings(tmp_path_factory.mktemp("home"), stream_write_timeout=1.0)
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        yield live


def _stalled_client(port: int, path: str, body: dict) -> socket.socket:
    """A client that sends a streaming request and then reads nothing, with a tiny receive buffer
    (set before connecting, so the TCP window stays small)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a long story."}]}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
])
def test_a_client_that_stops_reading_is_dropped_and_its_sequence_freed(server, path, body):
    assert server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})[0] == 200
    before = server.engine_stats()["cancelled"]
    body = {"model": MODEL, "stream": True, "max_tokens": 900, "temperature": 0, "logit_bias": BAN_EOS, **body}
    client = _stalled_client(server.port, path, body)
    try:
        assert _wait_for(lambda: server.engine_stats()["running"] == 1, 60)
        # Liveness bound: buffers fill within a few hundred tokens, then 1 s of write timeout.
        assert _wait_for(lambda: server.engine_stats()["running"] == 0, 120)
        stats = server.engine_stats()
        assert stats["cancelled"] == before + 1  # cancelled, not run to its 900 tokens
        # The server dropped the connection: after what was buffered, the client reads EOF.
        client.settimeout(30)
        received = b""
        while chunk := client.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"data: " in received  # it was streaming
    finally:
        client.close()
    status, r = server.json("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and r["choices"][0]["message"]["content"]


async def test_engine_stops_a_sequence_its_reader_fell_far_behind():
    backend = FakeBackend(n_ctx=4096, n_batch=64, n_seq_max=4, step_time=0.001)
    limits = EngineLimits(max_sequences=2, batch_tokens=64, n_ctx=4096, n_ctx_seq=4096)
    engine = Engine(backend, limits, name="fake")
    engine.stream_buffer_events = 32
    engine.start()
    try:
        request = GenerationRequest(prompt_tokens=[5, 6, 7], max_tokens=2000, sampling=SamplingParams(temperature=0))
        stream = engine.submit(request)
        while engine.stats().running or engine.active_requests():  # nobody reads meanwhile
            await asyncio.sleep(0.01)
        events = [event async for event in stream]
        assert stream.overflowed and events[-1].finish_reason == "cancelled"
        tokens = sum(len(e.token_ids) for e in events)
        assert 32 <= len(events) <= 40 and tokens < 2000  # the queue stayed bounded; no token was dropped
        assert engine.stats().cancelled == 1
        # A reader that keeps up is never cut off.
        full = engine.submit(GenerationRequest(prompt_tokens=[5, 6, 8], max_tokens=300,
                                               sampling=SamplingParams(temperature=0)))
        events = [event async for event in full]
        assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 300
    finally:
        engine.shutdown()
