"""The server against the ModelEngine protocol alone: a second, minimal engine (no Backend, no
Scheduler) served through the real aiohttp app and the real ModelManager.

EchoEngine batches nothing and computes nothing: bytes are its tokens and it answers with the
prompt's own tokens. That is enough to tell whether every route reaches the engine only through
ModelEngine members (a route that reached for `engine.backend` or the scheduler would fail here)
and whether answers are shaped and refused as with the real engine. It also checks that bad
sampling fields are refused by the one shared validator before the manager loads anything.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from fake_backend import FakeBackend
from localserve.batching.limits import EngineLimits
from localserve.engine.local import Engine
from localserve.protocol.engine import EngineStats, EventStream, ModelEngine, ModelInfo
from localserve.errors import ContextLengthExceededError, InvalidRequestError
from localserve.protocol.requests import LANES, GenerationEvent, GenerationRequest, SamplingParams, Usage
from scheduler_harness import backend_calls
from server_harness import MODEL, LiveServer, install_model, server_settings

# The last message's content is the whole prompt, so the echo is predictable.
TEMPLATE = "{{ messages[-1]['content'] }}"
N_CTX = 512


class EchoStream:
    """Yields the request's prompt tokens back, one event per token, up to max_tokens."""

    def __init__(self, engine: "EchoEngine", request: GenerationRequest):
        self.engine = engine
        self.request = request
        self.cancelled = False
        self._sent = 0
        self._done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> "EchoStream":
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        await asyncio.sleep(0)  # a real engine answers from elsewhere; let other tasks run
        prompt, limit = self.request.prompt_tokens, self.request.max_tokens
        if self.cancelled:
            return self._finish("cancelled", [])
        token = prompt[self._sent]
        self._sent += 1
        if self._sent == len(prompt) or self._sent == limit:
            return self._finish("stop" if self._sent == len(prompt) else "length", [token])
        return GenerationEvent(text=self.engine.detokenize([token]), token_ids=[token])

    def _finish(self, reason: str, tokens: list[int]) -> GenerationEvent:
        self._done = True
        self.engine.finished += 1
        usage = Usage(prompt_tokens=len(self.request.prompt_tokens), completion_tokens=self._sent, cached_tokens=0)
        return GenerationEvent(text=self.engine.detokenize(tokens), token_ids=tokens,
                               finish_reason=reason, usage=usage)  # type: ignore[arg-type]


class EchoEngine:
    """A ModelEngine with no Backend and no Scheduler (as onnxruntime-genai's engine would be)."""

    def __init__(self, name: str):
        self.name = name
        self._info = ModelInfo(name=name, architecture="echo", n_ctx_train=N_CTX, n_vocab=256, n_embd=4,
                               n_params=0, chat_template=TEMPLATE, bos_token=None, eos_token=None)
        self.streams: list[EchoStream] = []
        self.finished = 0
        self.closed = False

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx_per_seq(self) -> int:
        return N_CTX

    async def generate(self, request: GenerationRequest) -> EventStream:
        request.sampling.validate(self._info.n_vocab)
        if len(request.prompt_tokens) >= N_CTX:
            raise ContextLengthExceededError(f"the prompt has {len(request.prompt_tokens)} tokens", param="prompt")
        stream = EchoStream(self, request)
        self.streams.append(stream)
        return stream

    async def embed(self, inputs: list[list[int]], lane: str = "default") -> list[list[float]]:
        if not inputs:
            raise InvalidRequestError("nothing to embed", param="input")
        vectors = []
        for tokens in inputs:  # byte statistics, normalised: enough to tell inputs apart
            v = [float(len(tokens)), float(sum(tokens)), float(max(tokens)), float(min(tokens))]
            norm = math.sqrt(sum(x * x for x in v))
            vectors.append([x / norm for x in v])
        return vectors

    async def rank(self, inputs: list[list[int]], lane: str = "default") -> list[float]:
        raise InvalidRequestError(f"model {self.name} is not a reranker", param="model")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        return [bytes([t]) for t in tokens]

    def stats(self) -> EngineStats:
        running = sum(not s._done for s in self.streams)
        return EngineStats(running=running, waiting=dict.fromkeys(LANES, 0), kv_used=0, kv_total=0,
                           tokens_per_s=0.0, prompt_tokens_per_s=0.0, prefix_cache_hits=0,
                           prefix_cache_queries=0, prefix_cache_hit_rate=0.0, steps=0, busy=running > 0)

    def shutdown(self, timeout: float = 10.0) -> None:
        for stream in self.streams:
            stream.cancel()
        self.closed = True


class EchoLoader:
    def __init__(self) -> None:
        self.engines: list[EchoEngine] = []

    def __call__(self, installed, settings) -> EchoEngine:
        self.engines.append(EchoEngine(installed.ref))
        return self.engines[-1]


@pytest.fixture(scope="module")
def echo(tmp_path_factory, smollm2_gguf: Path):
    """A live server whose manager loads EchoEngines (the model file only gives the store an entry)."""
    settings = server_settings(tmp_path_factory.mktemp("echo-home"))
    install_model(settings, smollm2_gguf)
    loader = EchoLoader()
    with LiveServer(settings, loader=loader) as live:
        live.loader_calls = loader.engines
        yield live


def test_both_engines_satisfy_the_protocol():
    engine = Engine(FakeBackend(n_ctx=256, n_batch=64), EngineLimits(max_sequences=4, batch_tokens=64, n_ctx=256, n_ctx_seq=256))
    assert isinstance(engine, ModelEngine) and isinstance(EchoEngine("x"), ModelEngine)
    assert engine.detokenize(engine.tokenize("abc", add_special=False)) == "abc"


async def test_the_local_engine_reaches_its_backend_only_through_the_step():
    """Behind the protocol, our engine's scheduler plans KV operations as data (a prefix copy, a
    parked entry moved out of the running ids) and its thread calls the backend's decode and KV
    methods only from engine/step.py; by the time a request's last event arrives, the cells it gave
    back are gone from the cache too (not at some later step), so an idle engine's cache holds
    what its books say. (The OGA and upstream engines have no Backend or plan: the tests above
    serve them.)"""
    system = [3, 4, 5, 6] * 10
    for prefix_cache in (True, False):
        backend = FakeBackend(n_ctx=1024, n_batch=64, n_seq_max=8, step_time=0.001)
        engine = Engine(backend, EngineLimits(max_sequences=2, batch_tokens=64, n_ctx=1024, n_ctx_seq=1024,
                                              prefix_cache=prefix_cache))
        with backend_calls(backend) as calls:
            engine.start()
            try:
                streams = [await engine.generate(GenerationRequest(prompt_tokens=system + [7 + i, 8], max_tokens=8,
                                                                   sampling=SamplingParams(temperature=0)))
                           for i in range(4)]
                last = [[event async for event in stream][-1] for stream in streams]
                kv_used, cells = engine.stats().kv_used, backend.used_cells
            finally:
                engine.shutdown()
        assert [e.finish_reason for e in last] == ["length"] * 4
        assert {caller for *_, caller in calls} == {"localserve.engine.step"}
        names = {name for name, *_ in calls}
        if prefix_cache:  # finished requests parked: the later ones copy the system prompt
            assert sum(e.usage.cached_tokens for e in last) > 0 and {"decode", "kv_copy", "kv_move"} <= names
            assert cells == kv_used > 0
        else:  # each finished request's cells were removed before its last event was sent
            assert "kv_copy" not in names and "kv_remove" in names
            assert cells == kv_used == 0


def test_bad_sampling_fields_are_refused_before_any_load(echo):
    """top_p 0 and repeat_penalty 0 used to pass the server and fail in llama.cpp's sampler, after
    the model had been loaded for them; now the shared validator refuses them first."""
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "repeat_penalty": 0}, "repeat_penalty"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": math.inf}}, "logit_bias"),
        ("/api/generate", {"prompt": "hi", "options": {"top_p": 0}}, "options.top_p"),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"repeat_penalty": 0}},
         "options.repeat_penalty"),
    ]
    before = len(echo.loader_calls)
    for path, body, param in cases:
        status, answer = echo.json("POST", path, {"model": MODEL, **body})
        assert status == 400, (path, answer)
        if path.startswith("/v1"):
            assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
        else:
            assert set(answer) == {"error"} and answer["error"].startswith(f"'{param}' must be"), answer
    assert len(echo.loader_calls) == before  # nothing was loaded for any of them


def test_openai_routes_serve_a_non_backend_engine(echo):
    status, answer = echo.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "n": 2, "max_tokens": 5})
    assert status == 200, answer
    assert [c["message"]["content"] for c in answer["choices"]] == ["hello", "hello"]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
    assert answer["usage"] == {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21,
                               "prompt_tokens_details": {"cached_tokens": 0},
                               "completion_tokens_details": {"reasoning_tokens": 0}}

    status, _, raw = echo.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "stream me"}], "stream": True})
    frames = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and frames[-1] == "[DONE]"
    text = "".join(json.loads(f)["choices"][0]["delta"].get("content") or "" for f in frames[:-1])
    assert text == "stream me"

    status, answer = echo.json("POST", "/v1/completions", {"model": MODEL, "prompt": ["ab", [104, 105]], "echo": False})
    assert status == 200 and [c["text"] for c in answer["choices"]] == ["ab", "hi"]

    status, answer = echo.json("POST", "/v1/embeddings", {"model": MODEL, "input": ["a", "bb"]})
    assert status == 200 and len(answer["data"]) == 2 and len(answer["data"][0]["embedding"]) == 4
    status, answer = echo.json("POST", "/v1/embeddings", {"model": MODEL, "input": "a", "dimensions": 3})
    assert status == 400 and answer["error"]["param"] == "dimensions"

    status, answer = echo.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


def test_ollama_routes_and_ps_serve_a_non_backend_engine(echo):
    status, answer = echo.json("POST", "/api/generate", {"model": MODEL, "prompt": "echo", "stream": False})
    assert status == 200 and answer["response"] == "echo" and answer["done_reason"] == "stop"
    assert answer["context"] == list(b"echo") * 2  # the prompt, then what was generated

    status, _, raw = echo.request("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "yo"}]})
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert status == 200 and "".join(line["message"]["content"] for line in lines) == "yo" and lines[-1]["done"]

    status, answer = echo.json("POST", "/api/embed", {"model": MODEL, "input": "abc"})
    assert status == 200 and len(answer["embeddings"]) == 1 and answer["prompt_eval_count"] == 3

    status, answer = echo.json("GET", "/api/ps")
    assert status == 200 and [m["name"] for m in answer["models"]] == [f"{MODEL}:Q4_1"]
    assert answer["models"][0]["running"] == 0  # every stream above finished or was cancelled
    engine = echo.loader_calls[-1]
    assert engine.streams and all(s._done or s.cancelled for s in engine.streams)
