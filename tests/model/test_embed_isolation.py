"""Embeddings share the engine thread with generation: a maximal request runs one decode at a time
between generation steps, is refused past settings.max_embed_tokens before any work, and stops
when its client leaves. Real model, real in-process server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from fake_backend import FakeBackend
from localserve.batching.limits import EngineLimits
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.engine.local import Engine
from server_harness import MODEL, LiveServer, install_model, server_settings

# The configured cap (the default is 300k): small enough that a maximal request embeds in well
# under the per-test timeout on a 2-core machine.
MAX_EMBED_TOKENS = 2_000
BAN_EOS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens: the chat runs to max_tokens


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    # In process (engine_workers off): the tests count the backend's embedding decodes in place.
    # Token-id inputs (embed_token_ids): the maximal request is ids, so its size is exact.
    settings = server_settings(tmp_path_factory.mktemp("home"), max_embed_tokens=MAX_EMBED_TOKENS,
                               engine_workers=False, embed_token_ids=True)
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        yield live


def _engine(server: LiveServer):
    assert server.json("POST", "/v1/embeddings", {"model": MODEL, "input": "load"})[0] == 200

    async def get():
        (loaded,) = server.manager._loaded.values()
        return loaded.engine

    return server.call(get())


def _maximal_inputs(server: LiveServer) -> list[list[int]]:
    """Token-id inputs summing to exactly the cap, each the context's length (1024) or less."""
    inputs, left, i = [], MAX_EMBED_TOKENS, 0
    while left:
        n = min(1000, left)
        inputs.append([(100 + i * 7 + k) % 40000 + 50 for k in range(n)])
        left -= n
        i += 1
    return inputs


def _count_embed_steps(engine) -> list[int]:
    """Count the decodes the engine runs for embeddings (the real generator, counted as it goes)."""
    counter = [0]
    real = engine.backend.embed_steps

    def counted(inputs):
        gen = real(inputs)
        try:
            while True:
                value = next(gen)
                counter[0] += 1
                yield value
        except StopIteration as done:
            return done.value
        finally:
            gen.close()

    engine.backend.embed_steps = counted
    return counter


def test_token_cap_is_checked_before_any_work(server):
    # The cap counts the tokens a request would embed: inputs that each fit the context (1024) but
    # together pass it. An input longer than the context is refused for that (without truncate)
    # whatever the total, since no split of the request would help it; with truncate it counts as
    # cut (see test_a_truncated_input_counts_as_cut).
    part = "hello world " * 450  # 901 tokens
    status, body = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": [part] * 3})  # 2,703
    assert status == 400 and body["error"]["param"] == "input" and body["error"]["type"] == "invalid_request_error"
    assert str(MAX_EMBED_TOKENS) in body["error"]["message"] and "max_embed_tokens" in body["error"]["message"]
    status, body = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": "hello world " * 7000})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "input"
    assert "14001 tokens" in body["error"]["message"] and "1024" in body["error"]["message"]
    engine = _engine(server)
    counter = _count_embed_steps(engine)
    try:
        status, body = server.json("POST", "/api/embed", {"model": MODEL, "input": ["hi there"] + [part] * 3})
        assert status == 400 and isinstance(body["error"], str) and str(MAX_EMBED_TOKENS) in body["error"]
        status, body = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": [[60] * 1000] * 3})
        assert status == 400
        assert counter[0] == 0  # nothing was embedded for the refused requests
        status, body = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": [[60] * 1000] * 2},
                                   timeout=280)
        assert status == 200 and len(body["data"]) == 2 and counter[0] > 0  # exactly the cap passes
    finally:
        del engine.backend.embed_steps


def test_a_truncated_input_counts_as_cut(server):
    """Ollama's truncate (on by default) cuts each input to the context: what is embedded, and so
    what the cap counts, is 1024 tokens an input, however long the texts were."""
    long_text = "hello world " * 3000  # 6,001 tokens: one is past the cap before truncation
    status, body = server.json("POST", "/api/embed", {"model": MODEL, "input": [long_text]})
    assert status == 200 and len(body["embeddings"]) == 1 and body["prompt_eval_count"] == 1024
    status, body = server.json("POST", "/api/embed", {"model": MODEL, "input": [long_text] * 2})  # 2,048
    assert status == 400 and str(MAX_EMBED_TOKENS) in body["error"]
    status, body = server.json("POST", "/api/embed", {"model": MODEL, "input": long_text, "truncate": False})
    assert status == 400 and "6001 tokens" in body["error"]


@pytest.mark.timeout(900)  # a liveness bound: ~6k tokens of model work on a shared 2-core machine
def test_maximal_embeddings_request_while_a_chat_streams(server):
    inputs = _maximal_inputs(server)
    alone = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": [inputs[1]]})[1]["data"][0]["embedding"]

    chat_times: list[float] = []  # when each content chunk came (one step's tokens: several when drafted)
    replies: list[bytes] = []
    first_token = threading.Event()

    def chat() -> None:
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 0,
                           "logit_bias": BAN_EOS, "messages": [{"role": "user", "content": "Tell a long story."}]})
        with socket.create_connection(("127.0.0.1", server.port), timeout=300) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
                n = buf.count(b'"content":')
                chat_times.extend([time.monotonic()] * (n - len(chat_times)))
                if len(chat_times) > 3:
                    first_token.set()
            replies.append(buf)

    chatter = threading.Thread(target=chat)
    chatter.start()
    assert first_token.wait(120)
    start = time.monotonic()
    status, body = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": inputs, "encoding_format": "float"},
                               timeout=600)
    end = time.monotonic()
    chatter.join(600)
    assert status == 200 and len(body["data"]) == len(inputs)
    assert body["usage"]["prompt_tokens"] == MAX_EMBED_TOKENS
    assert body["data"][1]["embedding"] == pytest.approx(alone, abs=1e-4)  # same vector as alone
    during = [t for t in chat_times if start < t < end]
    # Before, the whole request was one job on the engine thread and the chat got nothing until it
    # ended; now decode steps run between its embedding decodes.
    assert len(during) >= 5, (len(during), end - start, len(chat_times))  # 11 here: ~one a step
    assert b'"finish_reason":"length"' in replies[0]  # and the chat ran to its end (400 tokens)


def test_a_client_that_leaves_cancels_the_remaining_inputs(server):
    engine = _engine(server)
    counter = _count_embed_steps(engine)
    try:
        body = json.dumps({"model": MODEL, "input": _maximal_inputs(server)})
        s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        s.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 120
        while counter[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert counter[0] >= 2
        s.close()
        deadline = time.monotonic() + 30
        while engine._embeds and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine._embeds  # the job left the engine ...
        steps_at_cancel = counter[0]
        n_batch = engine.backend.n_batch
        assert steps_at_cancel < MAX_EMBED_TOKENS // n_batch  # ... long before its decodes were done
        # and the embeddings context is clean for the next request
        status, r = server.json("POST", "/v1/embeddings", {"model": MODEL, "input": "hello world"})
        assert status == 200 and len(r["data"][0]["embedding"]) == 576
    finally:
        del engine.backend.embed_steps


# --- the engine's scheduling of embeddings, over the fake backend ---------------------------------
class _PiecewiseBackend(FakeBackend):
    """Embeds one input per piece (as the llama.cpp backend does one decode per piece) and records
    the engine's generation step count at each piece."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.pieces: list[int] = []
        self.engine: Engine | None = None

    def embed_steps(self, inputs):
        out = []
        for tokens in inputs:
            time.sleep(0.002)
            self.pieces.append(self.engine.scheduler.step)
            out.extend(self.embed([tokens]))
            yield True
        return out


def _fake_engine() -> tuple[Engine, _PiecewiseBackend]:
    backend = _PiecewiseBackend(n_ctx=2048, n_batch=64, n_seq_max=4, step_time=0.002)
    engine = Engine(backend, EngineLimits(max_sequences=2, batch_tokens=64, n_ctx=2048, n_ctx_seq=2048), name="fake")
    backend.engine = engine
    engine.start()
    return engine, backend


async def test_engine_interleaves_embedding_pieces_with_generation_steps():
    engine, backend = _fake_engine()
    try:
        stream = engine.submit(GenerationRequest(prompt_tokens=[3, 4], max_tokens=300,
                                                 sampling=SamplingParams(temperature=0)))
        inputs = [[i + 1, i + 2] for i in range(100)]
        vectors = await engine.embed(inputs)
        assert vectors == backend.embed(inputs)
        steps = backend.pieces
        # A generation step ran between (nearly) every two pieces, not all pieces in one go.
        assert sum(b > a for a, b in zip(steps, steps[1:])) >= 90
        events = [e async for e in stream]
        assert events[-1].finish_reason == "length"
    finally:
        engine.shutdown()


async def test_engine_drops_the_rest_of_a_cancelled_embedding():
    engine, backend = _fake_engine()
    try:
        task = asyncio.ensure_future(engine.embed([[7, i + 1] for i in range(5000)]))
        while len(backend.pieces) < 5:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine._embeds:
            await asyncio.sleep(0.005)
        done = len(backend.pieces)
        assert done < 5000
        assert await engine.embed([[1, 2]]) == backend.embed([[1, 2]])  # the engine serves on
        assert len(backend.pieces) == done + 1
    finally:
        engine.shutdown()
