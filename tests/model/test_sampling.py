"""Per-sequence sampling on the real SmolLM2-135M: seeds, penalties, logit_bias, grammars, logprobs."""

from __future__ import annotations

import gc
import json
import math

import pytest

from localserve.backends.base import BatchToken
from localserve.backends.common.grammar import grammar_text
from localserve.protocol.requests import SamplingParams
from localserve.errors import InvalidRequestError
from llamacpp_helpers import generate, load, prompt_batch, text_of

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    b = load(smollm2_gguf, exact=True)
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _clean_kv(backend):
    backend.kv_clear()


def _run(backend, params, prompt_text, n=12, **kw):
    prompt = backend.tokenize(prompt_text)
    sampler = backend.new_sampler(params, prompt)
    try:
        return generate(backend, sampler, prompt, n, **kw)
    finally:
        sampler.close()


# --- seeds ---------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(backend):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    first = _run(backend, params, "Once upon a time", stop_at_eog=False)
    assert _run(backend, params, "Once upon a time", stop_at_eog=False) == first
    others = {tuple(_run(backend, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s),
                         "Once upon a time", stop_at_eog=False)) for s in (1, 2, 3)}
    assert len(others | {tuple(first)}) > 1  # the seed matters


def test_seeded_sequence_is_the_same_inside_a_mixed_batch(backend):
    seeded = SamplingParams(temperature=0.9, seed=7)
    prompt = backend.tokenize("Write a sentence about the sea.")
    alone = _run(backend, seeded, "Write a sentence about the sea.", n=10, stop_at_eog=False)

    backend.kv_clear()
    others = [backend.tokenize("List three colours:"), backend.tokenize("The weather today")]
    samplers = [
        backend.new_sampler(seeded, prompt),
        backend.new_sampler(SamplingParams(temperature=1.2, seed=99), others[0]),
        backend.new_sampler(SamplingParams(temperature=0.7), others[1]),  # unseeded neighbour
    ]
    prompts = [prompt] + others
    batch, rows = [], []
    for s, p in enumerate(prompts):
        batch += prompt_batch(p, s)
        rows.append(len(batch) - 1)
    backend.decode(batch)
    pos = [len(p) for p in prompts]
    out = [[], [], []]
    for _ in range(10):
        for s in range(3):
            out[s].append(samplers[s].sample(rows[s]).token)
        backend.decode([BatchToken(out[s][-1], s, pos[s], True) for s in range(3)])
        rows = [0, 1, 2]
        pos = [p + 1 for p in pos]
    for smp in samplers:
        smp.close()
    assert out[0] == alone


# --- logit bias and penalties ------------------------------------------------------------------------
def test_minus_inf_logit_bias_bans_a_token(backend):
    greedy = _run(backend, SamplingParams(temperature=0.0), "The capital of France is", n=1)
    banned = greedy[0]
    out = _run(backend, SamplingParams(temperature=0.0, logit_bias={banned: -math.inf}),
               "The capital of France is", n=8)
    assert banned not in out
    # Also under temperature sampling, for many seeds.
    for seed in range(5):
        out = _run(backend, SamplingParams(temperature=1.5, top_k=0, min_p=0.0, seed=seed,
                                           logit_bias={banned: -math.inf}), "The capital of France is", n=3)
        assert banned not in out


def test_positive_logit_bias_forces_a_token(backend):
    forced = backend.tokenize(" banana", add_special=False)[0]
    out = _run(backend, SamplingParams(temperature=0.0, logit_bias={forced: 100.0}), "The capital of France is", n=3)
    assert out == [forced] * 3


REPETITIVE = "red, blue, red, blue, red, blue, red,"


@pytest.mark.parametrize("penalty", [{"repeat_penalty": 5.0}, {"presence_penalty": 30.0}, {"frequency_penalty": 30.0}])
def test_penalties_steer_away_from_prompt_tokens(backend, penalty):
    blue = backend.tokenize(" blue", add_special=False)[0]
    plain = _run(backend, SamplingParams(temperature=0.0), REPETITIVE, n=3)
    assert plain[0] == blue  # the model continues the pattern
    out = _run(backend, SamplingParams(temperature=0.0, **penalty), REPETITIVE, n=3)
    # Primed with the prompt, so even the first token avoids what the prompt already used.
    assert out[0] not in backend.tokenize(REPETITIVE)


def test_penalty_window_zero_disables_penalties(backend):
    plain = _run(backend, SamplingParams(temperature=0.0), REPETITIVE, n=4)
    assert _run(backend, SamplingParams(temperature=0.0, repeat_penalty=5.0, penalty_last_n=0), REPETITIVE, n=4) == plain


@pytest.mark.parametrize("last_n", [-1, 10**9])
def test_penalty_window_whole_context_and_huge(backend, last_n):
    out = _run(backend, SamplingParams(temperature=0.0, repeat_penalty=5.0, penalty_last_n=last_n), REPETITIVE, n=2)
    assert out[0] not in backend.tokenize(REPETITIVE)


# --- grammars --------------------------------------------------------------------------------------
def test_gbnf_grammar_constrains_output(backend):
    params = SamplingParams(temperature=0.0, grammar='root ::= "yes" | "no"')
    out = _run(backend, params, CHAT.format("Is the sky green? Answer in one word."), n=8)
    assert backend.is_eog(out[-1])  # the grammar is complete, so only end-of-generation is allowed
    assert text_of(backend, out[:-1]) in ("yes", "no")
    for seed in range(4):
        params = SamplingParams(temperature=1.5, top_k=0, min_p=0.0, seed=seed, grammar='root ::= "yes" | "no"')
        out = _run(backend, params, CHAT.format("Tell me a story."), n=8)
        assert text_of(backend, out[:-1]) in ("yes", "no")


def test_grammar_with_penalties_and_bias_never_sees_the_prompt(backend):
    # Penalties are primed with prompt tokens; the grammar must not be (a mismatch would abort).
    no = backend.tokenize("no", add_special=False)[0]
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, grammar='root ::= "yes" | "no"', logit_bias={no: -math.inf})
    out = _run(backend, params, CHAT.format("Say yes or no. yes no yes no"), n=8)
    assert text_of(backend, out[:-1]) == "yes" and backend.is_eog(out[-1])


def test_json_schema_output_parses_and_matches(backend):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 2},
        },
        "required": ["name", "age", "pets"],
    }
    for params in (SamplingParams(temperature=0.0, json_schema=schema),
                   SamplingParams(temperature=1.0, seed=5, json_schema=schema)):
        out = _run(backend, params, CHAT.format("Describe a person as JSON."), n=80)
        assert backend.is_eog(out[-1])
        value = json.loads(text_of(backend, out[:-1]))
        assert list(value) == ["name", "age", "pets"]  # the schema's property order
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert all(p in ("cat", "dog") for p in value["pets"]) and len(value["pets"]) <= 2


def test_empty_json_schema_means_any_object(backend):
    out = _run(backend, SamplingParams(temperature=0.0, json_schema={}), CHAT.format("Give me JSON."), n=60)
    text = text_of(backend, out[:-1] if backend.is_eog(out[-1]) else out)
    if backend.is_eog(out[-1]):
        assert isinstance(json.loads(text), dict)
    else:  # ran out of tokens mid-object: still a valid prefix of one
        assert text.lstrip().startswith("{")


def test_invalid_grammar_is_a_clear_request_error(backend, capfd):
    with pytest.raises(InvalidRequestError, match="invalid grammar: unexpected end of input"):
        backend.new_sampler(SamplingParams(grammar='root ::= "yes'), [])
    with pytest.raises(InvalidRequestError, match="invalid grammar: expecting ::="):
        backend.new_sampler(SamplingParams(grammar='root = "x"'), [])
    with pytest.raises(InvalidRequestError, match="root"):
        backend.new_sampler(SamplingParams(grammar='foo ::= "x"'), [])
    assert "parse" not in capfd.readouterr().err  # llama.cpp's fprintf(stderr) was captured
    with pytest.raises(InvalidRequestError, match="not both"):
        backend.new_sampler(SamplingParams(grammar='root ::= "a"', json_schema={}), [])
    with pytest.raises(InvalidRequestError):
        backend.new_sampler(SamplingParams(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), [])
    # The backend is fine afterwards.
    assert _run(backend, SamplingParams(temperature=0.0), "Hello", n=1)


def test_grammar_with_everything_banned_fails_the_request_not_the_process(backend):
    # The grammar needs a token starting with "y"; ban all of them.
    banned = {t: -math.inf for t in range(backend.n_vocab) if backend.token_to_bytes(t).startswith(b"y")}
    params = SamplingParams(temperature=0.0, grammar='root ::= "yes"', logit_bias=banned)
    prompt = backend.tokenize("Answer:")
    sampler = backend.new_sampler(params, prompt)
    backend.decode(prompt_batch(prompt, 0))
    with pytest.raises(InvalidRequestError, match="no token"):
        sampler.sample(len(prompt) - 1)
    sampler.close()
    assert _run(backend, SamplingParams(temperature=0.0), "Hello", n=1)


def test_grammar_text_helper():
    assert grammar_text(SamplingParams()) is None
    assert "root" in grammar_text(SamplingParams(json_schema={}))
    gbnf = grammar_text(SamplingParams(json_schema={"type": "object", "properties": {"x": {"type": "boolean"}}}))
    assert "root ::=" in gbnf and "true" in gbnf
    with pytest.raises(InvalidRequestError):
        grammar_text(SamplingParams(grammar="   "))


# --- logprobs --------------------------------------------------------------------------------------
def test_logprobs(backend):
    prompt = backend.tokenize("The capital of France is")
    backend.decode(prompt_batch(prompt, 0))
    greedy = backend.new_sampler(SamplingParams(temperature=0.0, logprobs=5), prompt).sample(len(prompt) - 1)
    lp = greedy.logprob
    assert lp is not None and lp.token == greedy.token
    assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
    assert len(lp.top) == 5
    values = [v for _, _, v in lp.top]
    assert values == sorted(values, reverse=True) and all(math.isfinite(v) and v <= 0 for v in values)
    assert lp.top[0][0] == greedy.token and lp.top[0][2] == pytest.approx(lp.logprob)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6
    assert lp.text == text_of(backend, [greedy.token]) and all(isinstance(t, str) for _, t, _ in lp.top)

    sampled = backend.new_sampler(SamplingParams(temperature=1.0, seed=3, logprobs=0), prompt).sample(len(prompt) - 1)
    assert sampled.logprob.top == [] and sampled.logprob.logprob <= 0.0
    assert backend.new_sampler(SamplingParams(temperature=0.0), prompt).sample(len(prompt) - 1).logprob is None


# --- validation and lifecycle -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=0.0),
        SamplingParams(min_p=1.5),
        SamplingParams(top_k=-1),
        SamplingParams(temperature=math.nan),
        SamplingParams(repeat_penalty=0.0),
        SamplingParams(logit_bias={49152: 1.0}),
        SamplingParams(logit_bias={5: math.nan}),
        SamplingParams(logit_bias={5: math.inf}),
        SamplingParams(logprobs=-1),
    ],
)
def test_bad_sampling_params_are_request_errors(backend, params):
    with pytest.raises(InvalidRequestError):
        backend.new_sampler(params, [])


def test_garbage_collection_frees_the_native_chain(backend):
    sampler = backend.new_sampler(SamplingParams(temperature=0.8, seed=1, grammar='root ::= "a"'), [])
    finalizer = sampler._finalizer
    assert finalizer.alive
    del sampler
    gc.collect()
    assert not finalizer.alive


def test_close_is_idempotent(backend):
    prompt = backend.tokenize("Hi")
    sampler = backend.new_sampler(SamplingParams(temperature=0.8, seed=1), prompt)
    sampler.close()
    sampler.close()
    backend.decode(prompt_batch(prompt, 0))
    with pytest.raises(ValueError, match="closed"):
        sampler.sample(len(prompt) - 1)
    greedy = backend.new_sampler(SamplingParams(temperature=0.0), prompt)
    greedy.close()
    greedy.close()


def test_greedy_logit_bias_fast_path_picks_what_llama_cpp_picks(backend):
    """Greedy + logit_bias skips the native chain (numpy, llamacpp_sampling._biased_argmax); on the
    model's own logits, with biases that move the pick, tie it with the runner-up or ban it, it
    picks what llama.cpp's logit_bias + greedy chain picks."""
    from localserve.backends.llamacpp.sampling import _build_chain, _Candidates, _biased_argmax
    import llama_cpp
    import numpy as np

    prompt = backend.tokenize("The capital of France is")
    backend.decode(prompt_batch(prompt, 0))
    row = backend.logits(len(prompt) - 1)
    first, second = (int(i) for i in np.argsort(-row, kind="stable")[:2])
    gap = float(row[first] - row[second])
    for bias in ({first: -100.0}, {first: -gap, second: 0.0}, {second: gap}, {second: gap + 0.5, 7: 3.0},
                 {first: -math.inf, second: -math.inf}, {0: 100.0, 2: -100.0}):
        params = SamplingParams(temperature=0.0, logit_bias=bias)
        chain, _ = _build_chain(backend, params)
        try:
            cand = _Candidates(backend.n_vocab)
            cand.fill(backend.token_ids, row)
            llama_cpp.llama_sampler_apply(chain, cand.ref)
            expected = cand.selected()[0]
        finally:
            llama_cpp.llama_sampler_free(chain)
        ids = np.fromiter(bias, dtype=np.int64)
        assert _biased_argmax(row, ids, np.fromiter(bias.values(), dtype=np.float32)) == expected, bias
