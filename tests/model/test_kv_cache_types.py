"""KV-cache types per model on the real SmolLM2: K=q8_0/V=f16 (`model_kv_cache_type`) loads in
both KV layouts as llama.cpp reports it, a server answers with it, and `show` gives the memory it
saves."""

from __future__ import annotations

import argparse
import asyncio
import logging

import llama_cpp
import pytest

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.backends.llamacpp.runtime import captured_log
from localserve.commands.models import run_show
from localserve.runtime.describe import describe_model
from localserve.runtime.planning import plan_model
from localserve.store.cache import ModelStore

from localserve.protocol.requests import GenerationRequest
from server_harness import MODEL, MODEL_TAG, model_server
from test_engine_llamacpp import GREEDY, chat, run, running_engine
from worker_locks import THREADS

pytestmark = pytest.mark.model
MIXED = (f"{MODEL}=q8_0/f16",)


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_llamacpp_makes_the_cache_with_k_and_v_apart(smollm2_gguf, unified):
    with captured_log() as lines:
        backend = LlamaCppBackend.load(smollm2_gguf, n_ctx=512, n_seq_max=2, n_batch=64, n_threads=THREADS,
                                       kv_unified=unified, flash_attention=unified, kv_type="q8_0/f16")
    try:
        (cache,) = [line for line in lines if line.startswith("llama_kv_cache: size")]
        assert "K (q8_0)" in cache and "V (f16)" in cache
        # A quantized K alone leaves flash attention off in the streams layout: exact answers stay.
        assert any(line.endswith("flash_attn            = disabled") for line in lines) != unified
    finally:
        backend.close()


async def test_streams_with_a_q8_0_k_stay_exact(smollm2_gguf):
    """K q8_0 / V f16 needs no flash attention, so the streams layout keeps its promise: prompts
    of 20 to ~110 tokens that share their start, prefilled and decoded beside each other, give
    exactly the tokens each gives alone (test_engine_llamacpp's exactness test, with this cache)."""
    streams = LlamaCppBackend.load(smollm2_gguf, n_ctx=8192, n_seq_max=8, n_batch=512, n_threads=THREADS,
                                   kv_unified=False, flash_attention=False, kv_type="q8_0/f16")
    try:
        prompts = [chat(streams, " ".join(["Some background about the world and its details."] * (3 * i))
                        + f" Write a story about {topic}.")
                   for i, topic in enumerate(["the moon", "bread", "cats", "rivers"])]
        requests = lambda: [GenerationRequest(p, GREEDY, max_tokens=16, ignore_eos=True) for p in prompts]
        limits = dict(max_sequences=4, n_ctx_seq=1024, batch_tokens=512, kv_type="q8_0/f16")
        with running_engine(streams, prefix_cache=False, **limits) as engine:
            alone = [(await run(engine, r))[0] for r in requests()]
        with running_engine(streams, **limits) as engine:
            together = await asyncio.gather(*(run(engine, r) for r in requests()))
        assert [t for t, _, _ in together] == alone
    finally:
        streams.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf):
    # In the daemon's process (engine_workers off), where llama.cpp's load lines reach the test's log.
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, kv_layout="streams", engine_workers=False,
                      model_kv_cache_type=MIXED) as server:
        yield server


def test_a_model_with_k_q8_0_and_v_f16_answers_as_llamacpp_does(live, smollm2_gguf, caplog):
    caplog.set_level(logging.DEBUG, logger="localserve.llama")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, chat = live.json("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 12, "temperature": 0,
                                                              "messages": messages})
    assert status == 200 and chat["choices"][0]["message"]["content"].strip()
    # The same greedy answer as llama.cpp's own API loaded with K q8_0 and V f16.
    status, prompt = live.json("POST", "/tokenize", {"model": MODEL, "messages": messages})
    llm = llama_cpp.Llama(str(smollm2_gguf), n_ctx=1024, n_threads=THREADS, flash_attn=False, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_F16)
    try:
        direct = llm.create_completion(prompt["tokens"], max_tokens=12, temperature=0.0)
    finally:
        llm.close()
    assert chat["choices"][0]["message"]["content"] == direct["choices"][0]["text"]
    # The server's context (loaded first: the direct one above logs its own line after it) holds K
    # in q8_0 and V in f16 (llama.cpp's own load lines).
    cache = [r.getMessage() for r in caplog.records if r.getMessage().startswith("llama_kv_cache: size")]
    assert len(cache) == 2 and "K (q8_0)" in cache[0] and "V (f16)" in cache[0]
    plan = plan_model(ModelStore(live.settings).find(MODEL), live.settings)
    assert plan.limits.kv_type == "q8_0/f16" and not plan.limits.kv_unified and not plan.limits.flash_attention


def test_show_gives_the_memory_the_types_save(live, capsys):
    model = ModelStore(live.settings).find(f"{MODEL}:{MODEL_TAG}")
    memory = describe_model(model, live.settings)["memory"]
    assert memory["kv_bytes"] == pytest.approx(memory["kv_f16_bytes"] * (34 / 32 + 2) / 4, abs=1)
    assert run_show(argparse.Namespace(model=MODEL, ctx=None, json=False), live.settings) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "q8_0/f16: " in out and "less than f16" in out and "a KV stream each, q8_0/f16" in out
