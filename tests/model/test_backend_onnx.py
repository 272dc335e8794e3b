"""The ONNX Runtime backend on the real SmolLM2-135M, converted by our converter, against the
llama.cpp backend on the same GGUF: logits, greedy answers, packed mixed steps, KV operations,
sampling (grammars and JSON schemas too), embeddings, and 8 concurrent requests through our Engine +
Scheduler against each one alone."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from localserve.backends.base import BatchToken, DecodeInterrupted, KVFullError
from localserve.batching.limits import EngineLimits
from localserve.engine.local import Engine
from localserve.errors import InvalidRequestError
from localserve.protocol.requests import GenerationRequest, SamplingParams
from onnx_helpers import chat, greedy, prefill, smollm2_onnx  # noqa: F401 - smollm2_onnx: session fixture
from worker_locks import THREADS

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.model

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three primary colors.",
           "How many legs does a spider have?", "Translate 'good morning' into Spanish.",
           "What is 12 times 12?", "Name a planet with rings.", "Give me a synonym for happy."]


@pytest.fixture(scope="module")
def onnx_backend(smollm2_onnx, smollm2_gguf):  # noqa: F811
    from localserve.backends.onnx.load import load_onnx

    b = load_onnx(smollm2_onnx, smollm2_gguf, n_ctx=2048, n_seq_max=16, n_batch=256, n_threads=THREADS)
    yield b
    b.close()


@pytest.fixture(scope="module")
def llama(smollm2_gguf):
    from localserve.backends.llamacpp.backend import LlamaCppBackend

    b = LlamaCppBackend.load(smollm2_gguf, n_ctx=1024, n_seq_max=2, n_batch=256, n_threads=1,
                             exact_attention=True)
    yield b
    b.close()


def test_tokenizer_and_template_are_llamacpps(onnx_backend, llama):
    for text in ["Hello, world!", "<|im_start|>user\nñ 日本 🙂<|im_end|>", "  spaces\tand\nlines 12345"]:
        assert onnx_backend.tokenize(text) == llama.tokenize(text)
    assert onnx_backend.info.chat_template == llama.info.chat_template
    assert onnx_backend.info.n_vocab == llama.info.n_vocab and onnx_backend.info.n_ctx_train == 8192
    ids = llama.tokenize("ok 🙂")
    assert [onnx_backend.token_to_bytes(t) for t in ids] == [llama.token_to_bytes(t) for t in ids]
    assert onnx_backend.is_eog(2) and not onnx_backend.is_eog(ids[0])


def test_logits_close_to_llamacpp(onnx_backend, llama, record_property):
    worst = 0.0
    for text in PROMPTS[:3]:
        ids = chat(llama, text)
        llama.kv_clear()
        onnx_backend.kv_remove(0)
        ref, got = prefill(llama, 0, ids), prefill(onnx_backend, 0, ids)
        onnx_backend.kv_remove(0)
        worst = max(worst, float(np.abs(ref - got).max()))
        assert int(ref.argmax()) == int(got.argmax())
        # llama.cpp multiplies Q4_1 weights by Q8_1-quantized activations; we run the dequantized
        # weights in fp32: close, not equal (measured ~0.5-1.0 on logits of magnitude ~20).
        assert np.corrcoef(ref, got)[0, 1] > 0.999
    record_property("max_abs_logit_diff_vs_llamacpp", worst)
    print(f"max |logit diff| ONNX vs llama.cpp: {worst:.3f}")
    assert worst < 2.0


def test_greedy_answers_agree_with_llamacpp(onnx_backend, llama, record_property):
    agree = 0
    for text in PROMPTS:
        llama.kv_clear()
        ids = chat(llama, text)
        agree += greedy(onnx_backend, ids) == greedy(llama, ids)
    record_property("greedy_first8_agree", agree)
    print(f"greedy first 8 tokens agree on {agree}/8 prompts")
    assert agree >= 7


class _CountingSession:
    """The real session, counting run_with_iobinding calls."""

    def __init__(self, session):
        self._s, self.runs = session, 0

    def run_with_iobinding(self, io, run_options=None):
        self.runs += 1
        return self._s.run_with_iobinding(io, run_options)


def test_one_decode_and_another_prompt_in_one_run(onnx_backend):
    b = onnx_backend
    a_ids, b_ids = chat(b, PROMPTS[0]), chat(b, PROMPTS[1])
    for s in range(3):
        b.kv_remove(s)
    a_next = int(prefill(b, 0, a_ids).argmax())
    alone_b = prefill(b, 2, b_ids)  # B alone, on another id, for reference
    b.decode([BatchToken(a_next, 0, len(a_ids), True)])
    alone_a = b.logits(0)
    b.kv_remove(0, len(a_ids), -1)  # A back to its prompt: redo its decode beside B's prompt
    used, real = b.slots.used, b.session
    b.session = counting = _CountingSession(real)
    try:
        b.decode([BatchToken(a_next, 0, len(a_ids), True)]
                 + [BatchToken(t, 1, i, i == len(b_ids) - 1) for i, t in enumerate(b_ids)])
    finally:
        b.session = real
    assert counting.runs == 1
    assert b.slots.used - used == 1 + len(b_ids)  # exactly the batch's tokens: no padding rows
    assert np.abs(b.logits(0) - alone_a).max() < 1e-3
    assert np.abs(b.logits(len(b_ids)) - alone_b).max() < 1e-3
    assert int(b.logits(len(b_ids)).argmax()) == int(alone_b.argmax())
    for s in range(3):
        b.kv_remove(s)
    assert b.slots.used == 0


def test_kv_copy_shares_the_prefix(onnx_backend):
    b = onnx_backend
    ids = chat(b, PROMPTS[2])
    prefill(b, 0, ids[:-1])
    used = b.slots.used
    b.kv_copy(0, 1, 0, -1)
    assert b.slots.used == used and b.kv_pos_max(1) == len(ids) - 2  # shared, not copied
    b.decode([BatchToken(ids[-1], 1, len(ids) - 1, True)])
    via_copy = b.logits(0)
    b.kv_remove(0)
    assert b.slots.used == used + 1  # seq 1 still holds the shared prefix and its own token
    b.kv_remove(1)
    assert b.slots.used == 0
    assert np.abs(via_copy - prefill(b, 0, ids)).max() < 1e-3
    b.kv_remove(0)


def test_kv_full_keeps_nothing(smollm2_onnx, smollm2_gguf):  # noqa: F811
    from localserve.backends.onnx.load import load_onnx

    small = load_onnx(smollm2_onnx, smollm2_gguf, n_ctx=16, n_seq_max=2, n_batch=32, n_threads=1)
    try:
        prefill(small, 0, list(range(10, 22)))
        with pytest.raises(KVFullError):
            small.decode([BatchToken(t, 1, i) for i, t in enumerate(range(30, 36))])
        assert small.slots.used == 12 and small.kv_pos_max(1) == -1
        with pytest.raises(ValueError):
            small.decode([BatchToken(1, 5, 0)])  # sequence id out of range: refused before running
    finally:
        small.close()


def test_interrupt_stops_an_interruptible_run(onnx_backend):
    # What the batch lane's long steps rely on (Scheduler.execute): interrupt() from another thread
    # stops the run (ORT's RunOptions.terminate), nothing is kept, and the same batch run again
    # gives the logits it gives uninterrupted. Uninterruptible runs ignore the flag.
    b = onnx_backend
    assert b.capabilities.interruptible
    long = [BatchToken(100 + i % 50, 3, i, i == 199) for i in range(200)]
    started = time.perf_counter()
    b.decode(long)
    full_s = time.perf_counter() - started
    reference = b.logits(199)
    b.kv_remove(3)
    timer = threading.Timer(full_s / 4, b.interrupt)
    timer.start()
    started = time.perf_counter()
    with pytest.raises(DecodeInterrupted):
        b.decode(long, interruptible=True)
    assert time.perf_counter() - started < full_s * 3 / 4
    timer.join()
    assert b.kv_pos_max(3) == -1
    b.decode(long)
    np.testing.assert_array_equal(b.logits(199), reference)
    b.kv_remove(3)
    b.clear_interrupt()
    b.decode(long, interruptible=True)
    np.testing.assert_array_equal(b.logits(199), reference)
    b.kv_remove(3)


def test_sampling_semantics(onnx_backend):
    b = onnx_backend
    ids = chat(b, PROMPTS[1])
    b.kv_remove(0)
    prefill(b, 0, ids)
    row = len(ids) - 1
    seeded = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    draws = [b.new_sampler(seeded, ids).sample(row).token for _ in range(3)]
    assert len(set(draws)) == 1  # a seed reproduces the draw
    top = int(b.logits(row).argmax())
    banned = b.new_sampler(SamplingParams(temperature=0, logit_bias={top: -float("inf")}), ids).sample(row)
    assert banned.token != top
    forced = b.new_sampler(SamplingParams(temperature=0.7, logit_bias={42: 100.0}, logprobs=2), ids).sample(row)
    assert forced.token == 42 and len(forced.logprob.top) == 2 and forced.logprob.logprob <= 0
    with pytest.raises(InvalidRequestError):
        b.new_sampler(SamplingParams(top_p=0.0), ids)  # the shared validator's bounds
    b.kv_remove(0)


async def _answer(engine: Engine, ids: list[int]) -> list[int]:
    tokens: list[int] = []
    async for event in await engine.generate(GenerationRequest(ids, SamplingParams(temperature=0), max_tokens=24)):
        tokens += event.token_ids
    return tokens


def test_eight_concurrent_requests_match_each_alone(onnx_backend, record_property):
    b = onnx_backend
    prompts = [chat(b, t) for t in PROMPTS]
    limits = EngineLimits(max_sequences=8, batch_tokens=64, n_ctx=b.n_ctx, n_ctx_seq=512, prefix_cache=False)

    async def run(together: bool) -> list[list[int]]:
        engine = Engine(b, limits, name="smollm2-onnx")
        engine.start()
        try:
            if together:
                return list(await asyncio.gather(*[_answer(engine, p) for p in prompts]))
            return [await _answer(engine, p) for p in prompts]
        finally:
            engine.shutdown()

    alone = asyncio.run(run(False))
    together = asyncio.run(run(True))
    same = sum(a == t for a, t in zip(alone, together))
    record_property("concurrent_equal_alone", same)
    assert same == 8, [(a, t) for a, t in zip(alone, together) if a != t]
    assert b.slots.used == 0


def test_registry_loads_the_onnx_variant(tmp_path, smollm2_gguf, smollm2_onnx, onnx_backend):  # noqa: F811
    """A tag holding the GGUF and its converted folder, with backend=onnx: models.load_engine runs
    it on ONNX Runtime's CPU EP and answers as the backend does directly."""
    from pathlib import Path

    from localserve.runtime import manager as models
    from localserve.config.settings import load_settings
    from localserve.store.cache import ModelStore

    settings = load_settings(flags={"home": str(tmp_path), "backend": "onnx"}, environ={},
                             config_path=Path(tmp_path) / "none.toml")
    store = ModelStore(settings)
    store.register_local(smollm2_gguf, "smol")
    model = store.add_directory(smollm2_onnx, "smol")
    engine = models.load_engine(model, settings)
    try:
        assert engine.backend_name == "OnnxBackend"  # in its engine worker process
        ids = chat(onnx_backend, PROMPTS[0])
        want = greedy(onnx_backend, ids)
        end = next((i for i, t in enumerate(want) if onnx_backend.is_eog(t)), len(want))  # EOS not emitted
        assert asyncio.run(_answer(engine, ids))[:end] == want[:end]
    finally:
        engine.shutdown()


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_embeddings_agree_with_llamacpp(onnx_backend, llama, record_property):
    """The graph's final-norm rows pooled as the llama.cpp backend pools them: the same vectors (up to
    llama.cpp's quantized matmuls), also for an input longer than one decode (n_batch 256), with
    several inputs per call giving each one's alone vector, and no slot of the generation pool used."""
    texts = ["hello world", "The capital of France is Paris.", "ñ 日本 🙂", "word " * 400]
    inputs = [onnx_backend.tokenize(t) for t in texts]
    assert len(inputs[-1]) > 256
    assert onnx_backend.capabilities.embeddings
    used = onnx_backend.slots.used
    together = onnx_backend.embed(inputs)
    assert onnx_backend.slots.used == used
    want = llama.embed(inputs)
    cosines = [_cosine(o, w) for o, w in zip(together, want)]
    record_property("embedding_cosine_min", min(cosines))
    assert min(cosines) > 0.99, cosines
    for vec in together:
        assert len(vec) == 576 and abs(np.linalg.norm(vec) - 1.0) < 1e-5
    for ids, vec in zip(inputs, together):
        assert onnx_backend.embed([ids])[0] == pytest.approx(vec, abs=1e-5)


def test_embeddings_through_the_engine(onnx_backend):
    limits = EngineLimits(max_sequences=2, batch_tokens=64, n_ctx=onnx_backend.n_ctx, n_ctx_seq=512, prefix_cache=False)
    engine = Engine(onnx_backend, limits, name="smollm2-onnx")
    engine.start()
    try:
        ids = onnx_backend.tokenize("hello world")
        (vec,) = asyncio.run(engine.embed([ids]))
        assert vec == pytest.approx(onnx_backend.embed([ids])[0], abs=1e-5)
        with pytest.raises(InvalidRequestError):
            asyncio.run(engine.embed([[]]))
    finally:
        engine.shutdown()


def constrained(backend, ids: list[int], params: SamplingParams, n: int = 12) -> list[int]:
    """Up to n tokens sampled by `params` (stops at end of generation)."""
    backend.kv_remove(0)
    sampler, out = backend.new_sampler(params, ids), []
    prefill(backend, 0, ids)
    try:
        for k in range(n):
            out.append(sampler.sample(0 if k else len(ids) - 1).token)
            if backend.is_eog(out[-1]):
                break
            backend.decode([BatchToken(out[-1], 0, len(ids) + k, True)])
    finally:
        sampler.close()
        backend.kv_remove(0)
    return out


def test_grammar_and_json_schema_through_llamacpps_grammar_sampler(onnx_backend, llama):
    """Constrained output on ONNX: the same GBNF (grammar.py) and llama.cpp grammar sampler as the
    llama.cpp backend, on the numpy logits; greedy, both backends pick the same tokens."""
    b = onnx_backend
    assert b.capabilities.constraints == {"gbnf", "json_schema"}
    ids = chat(b, "Which city is the capital of France? Answer in JSON.")
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
              "required": ["city"], "additionalProperties": False}
    params = SamplingParams(temperature=0, json_schema=schema)
    got = constrained(b, ids, params, 16)
    text = b"".join(b.token_to_bytes(t) for t in got if not b.is_eog(t)).decode()
    assert json.loads(text)["city"] in ("Paris", "Lyon", "Nice")
    llama.kv_clear()
    assert got == constrained(llama, ids, params, 16)
    gbnf = constrained(b, ids, SamplingParams(temperature=0.8, seed=3, grammar='root ::= "yes" | "no"'), 4)
    assert b"".join(b.token_to_bytes(t) for t in gbnf if not b.is_eog(t)) in (b"yes", b"no")
    with pytest.raises(InvalidRequestError) as e:
        b.new_sampler(SamplingParams(grammar='root ::= ("unclosed'), ids)
    assert e.value.param == "grammar"
