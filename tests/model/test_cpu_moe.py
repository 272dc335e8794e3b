"""MoE experts kept in RAM (settings cpu_moe / n_cpu_moe; backends/llamacpp/moe.py) on a real MoE
GGUF (tests/moe_model.py: a tiny seeded Qwen3-MoE with SmolLM2's tokenizer), on this machine's CPU
build: the load takes llama-server's overrides, llama.cpp's own load log names exactly the expert
stacks of the layers asked for as overridden to the CPU, and greedy answers equal the plain load's.

On a CPU build every weight is in RAM either way, so this shows the overrides reach llama.cpp and
match the right tensors; that they keep those tensors off a GPU only a GPU build shows
(benchmarks/gpu_check.py's MoE stage)."""

from __future__ import annotations

import pytest

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.backends.llamacpp.moe import ALL_LAYERS
from localserve.protocol.requests import SamplingParams
from llamacpp_helpers import THREADS, generate
from moe_model import EXPERT_TENSORS, FILE_NAME, N_EMBD, N_EXPERT, N_FF_EXP, N_LAYER, build_moe, expert_tensor_names

PROMPT = "The capital of France is"
STEPS = 16


@pytest.fixture(scope="module")
def moe_gguf(smollm2_gguf, tmp_path_factory):
    return build_moe(smollm2_gguf, tmp_path_factory.mktemp("moe") / FILE_NAME)


def _load(path, cpu_moe_layers: int) -> LlamaCppBackend:
    return LlamaCppBackend.load(path, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=THREADS,
                                cpu_moe_layers=cpu_moe_layers, kv_unified=False, flash_attention=False)


def _greedy(backend: LlamaCppBackend) -> list[int]:
    tokens = backend.tokenize(PROMPT)
    return generate(backend, backend.new_sampler(SamplingParams(temperature=0.0), tokens), tokens, STEPS,
                    stop_at_eog=False)


@pytest.fixture(scope="module")
def plain(moe_gguf):
    backend = _load(moe_gguf, 0)
    try:
        yield backend.offload.overridden, _greedy(backend)
    finally:
        backend.close()


@pytest.mark.parametrize("cpu_moe_layers, layers", [(1, range(1)), (2, range(2)), (ALL_LAYERS, range(N_LAYER))])
def test_experts_of_the_asked_layers_are_overridden_and_answers_stay(moe_gguf, plain, cpu_moe_layers, layers):
    plain_overridden, plain_tokens = plain
    assert plain_overridden == {}
    backend = _load(moe_gguf, cpu_moe_layers)
    try:
        assert sorted(backend.offload.overridden) == sorted(expert_tensor_names(layers))
        assert set(backend.offload.overridden.values()) <= {"CPU", "CPU_REPACK"}
        assert backend.info.moe_layers_in_ram == len(layers)  # what `ps` prints beside a GPU load
        assert _greedy(backend) == plain_tokens
    finally:
        backend.close()


def test_the_model_is_a_real_moe_and_answers(plain, moe_gguf):
    from localserve.store.gguf_facts import read_gguf_facts

    facts = read_gguf_facts(moe_gguf)
    assert facts.architecture == "qwen3moe" and facts.n_layers == N_LAYER
    # The planner's count of what cpu_moe keeps in RAM: the F16 expert stacks, every layer.
    assert facts.expert_bytes == N_LAYER * len(EXPERT_TENSORS) * N_EXPERT * N_FF_EXP * N_EMBD * 2
    assert len(plain[1]) == STEPS
