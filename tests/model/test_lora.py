"""LoRA adapters (issue 45, item 5) on the real model through the real HTTP server.

The adapters are tests/lora_model.py's seeded ones for SmolLM2's attention matrices: id 0 stored
with the tag as `add --lora` stores it, id 1 from the setting model_loras. A request's greedy answer
with an adapter at a scale is the one llama.cpp loaded directly with that adapter at that scale gives,
and differs from the base model's; requests with different adapters submitted together (the scheduler
runs one set a step, batching/adapter_turns.py) answer as each alone; a model without adapters, an
unknown id and a bad scale are 400s in the dialect's own shape naming the model.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import llama_cpp
import openai
import pytest

from localserve.batching.adapter_turns import TURN_STEPS
from localserve.store.cache import ModelStore
from lora_model import ADAPTER_NAMES, write_adapter
from server_harness import MODEL, MODEL_TAG, LiveServer, server_settings

pytestmark = pytest.mark.model
PLAIN = "plain:latest"  # the same model without adapters
PROMPT = "The capital of France is"
N = 8


@pytest.fixture(scope="module")
def adapters(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("lora")
    return [write_adapter(smollm2_gguf, out / name, seed) for seed, name in enumerate(ADAPTER_NAMES, start=1)]


@pytest.fixture(scope="module")
def live(smollm2_gguf: Path, adapters: list[Path], tmp_path_factory: pytest.TempPathFactory):
    missing = adapters[0].parent / "gone" / "missing-lora.gguf"
    settings = server_settings(tmp_path_factory.mktemp("home"), context_length=512,
                               model_loras=(f"{MODEL}:{MODEL_TAG}={adapters[1]}", f"broken={missing}"))
    store = ModelStore(settings)
    store.register_local(smollm2_gguf, MODEL, MODEL_TAG, loras=[adapters[0]])
    store.register_local(smollm2_gguf, "plain", "latest")
    store.register_local(smollm2_gguf, "broken", "latest")
    with LiveServer(settings) as server:
        yield server


def completion(live, lora=None, model=f"{MODEL}:{MODEL_TAG}", prompt=PROMPT) -> list[int]:
    body = {"model": model, "prompt": prompt, "n_predict": N, "temperature": 0, "return_tokens": True,
            **({"lora": lora} if lora is not None else {})}
    status, answer = live.json("POST", "/completion", body)
    assert status == 200, answer
    return answer["tokens"]


def direct(gguf: Path, prompt: str, lora: Path, scale: float) -> list[int]:
    """llama.cpp's own greedy tokens, the adapter loaded as llama-cpp-python loads one."""
    llm = llama_cpp.Llama(str(gguf), n_ctx=256, n_batch=64, verbose=False, lora_path=str(lora), lora_scale=scale)
    try:
        tokens = llm.tokenize(prompt.encode())
        out = []
        for token in llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0):
            if llm.token_eos() == token or len(out) == N:
                break
            out.append(token)
        return out
    finally:
        llm.close()


def test_an_adapter_answers_as_llama_cpp_loaded_with_it_at_that_scale(live, smollm2_gguf, adapters):
    base = completion(live, lora=[])
    adapted = completion(live, lora=[{"id": 0, "scale": 0.5}])
    assert adapted != base
    assert adapted == direct(smollm2_gguf, PROMPT, adapters[0], 0.5)
    # No `lora`: every adapter of the model at scale 1 (llama-server's rule), and the plain model is the base.
    assert completion(live) not in (base, adapted)
    assert completion(live, model=PLAIN) == base


def test_different_adapters_submitted_together_answer_as_each_alone(live):
    """Longer than a turn (TURN_STEPS), so the two sets take turns mid-answer: the context's set
    switches back and forth while both sequences keep their cells."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    sets = [[{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}]]

    def ask(lora):
        answer = client.completions.create(model=f"{MODEL}:{MODEL_TAG}", prompt=PROMPT, max_tokens=TURN_STEPS + 8,
                                           temperature=0, extra_body={"lora": lora})
        return answer.choices[0].text, answer.usage.completion_tokens

    alone = [ask(lora) for lora in sets]
    assert alone[0] != alone[1] and all(n > TURN_STEPS for _, n in alone)  # neither ended before a turn
    with concurrent.futures.ThreadPoolExecutor(len(sets)) as pool:
        together = list(pool.map(ask, sets))
    assert together == alone


def test_unknown_ids_bad_scales_and_models_without_adapters_are_400s_naming_the_model(live):
    cases = [([{"id": 2, "scale": 1.0}], f"{MODEL}:{MODEL_TAG}", "adapter id 2"),
             ([{"id": 0, "scale": "strong"}], f"{MODEL}:{MODEL_TAG}", "scale"),
             ([{"id": 0, "scale": 1.0}], PLAIN, "no LoRA adapters")]
    for lora, model, says in cases:
        status, answer = live.json("POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "lora": lora})
        assert status == 400 and answer["error"]["param"] == "lora" and says in answer["error"]["message"], answer
        assert model in answer["error"]["message"]
        status, native = live.json("POST", "/completion", {"model": model, "prompt": "hi", "n_predict": 2,
                                                           "lora": lora})
        assert status == 400 and says in native["error"]["message"] and model in native["error"]["message"], native


def test_lora_adapters_and_api_show_list_the_adapters(live, adapters):
    status, listed = live.json("GET", f"/lora-adapters?model={MODEL}:{MODEL_TAG}")
    assert status == 200
    assert listed == [{"id": 0, "path": adapters[0].name, "scale": 1.0}, {"id": 1, "path": adapters[1].name, "scale": 1.0}]
    status, show = live.json("POST", "/api/show", {"model": f"{MODEL}:{MODEL_TAG}"})
    assert status == 200 and show["lora_adapters"] == listed
    assert f"ADAPTER {adapters[0].name}" in show["modelfile"]
    status, plain = live.json("GET", f"/lora-adapters?model={PLAIN}")
    assert status == 200 and plain == []


def test_a_missing_adapter_in_model_loras_fails_the_load_naming_the_entry_not_its_folder(live):
    status, answer = live.json("POST", "/completion", {"model": "broken", "prompt": "hi", "n_predict": 1})
    message = answer["error"]["message"]
    assert status >= 400 and "model_loras" in message and "missing-lora.gguf" in message, answer
    assert "/gone/" not in message
