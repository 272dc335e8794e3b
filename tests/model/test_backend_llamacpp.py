"""The llama.cpp backend on the real SmolLM2-135M: packed batches, KV ops, tokenizer, embeddings."""

from __future__ import annotations

import logging
import threading
import time

import llama_cpp
import numpy as np
import pytest

from localserve.backends.base import BatchToken, DecodeInterrupted, KVFullError
from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.backends.llamacpp.baseline import greedy_bare_loop
from localserve.protocol.requests import SamplingParams
from localserve.errors import (
    BackendError,
    ContextLengthExceededError,
    GGUFError,
    InvalidRequestError,
    ModelNotFoundError,
)
from llamacpp_helpers import THREADS, generate, load, prompt_batch, text_of

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "Here is a short list of fruits, written one per line, in alphabetical order, starting with apple:",
    "1, 2, 3,",
]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    b = load(smollm2_gguf)
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _clean_kv(backend):
    backend.kv_clear()


# --- model facts -------------------------------------------------------------------------------
def test_model_info(backend):
    info = backend.info
    assert info.architecture == "llama"
    assert "Smollm2" in info.name
    assert (info.n_vocab, info.n_embd, info.n_ctx_train) == (49152, 576, 8192)
    assert 130_000_000 < info.n_params < 140_000_000
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert info.bos_token == "<|im_start|>" and info.eos_token == "<|im_end|>"
    assert info.metadata["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in info.metadata  # huge arrays are left out
    assert (backend.n_ctx, backend.n_batch, backend.n_seq_max) == (2048, 512, 8)
    assert backend.n_ubatch == 512


# --- packed batches ------------------------------------------------------------------------------
def _alone(backend, tokens, steps):
    """Greedy tokens and the first logits row for one prompt decoded by itself in seq 0."""
    backend.kv_clear()
    backend.decode(prompt_batch(tokens, 0))
    first = backend.logits(len(tokens) - 1)
    backend.kv_clear()
    sampler = backend.new_sampler(GREEDY, tokens)
    return generate(backend, sampler, tokens, steps, stop_at_eog=False), first


def test_packed_batch_matches_each_prompt_alone(backend):
    prompts = [backend.tokenize(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    steps = 6
    expected = [_alone(backend, p, steps) for p in prompts]

    backend.kv_clear()
    # Prompts 0 and 1 share the first batch; prompt 2 joins while the others already decode,
    # so decode tokens and a whole prompt sit side by side in one batch (no padding).
    batch = prompt_batch(prompts[0], 0) + prompt_batch(prompts[1], 1)
    rows = {0: len(prompts[0]) - 1, 1: len(batch) - 1}
    backend.decode(batch)
    for s in (0, 1):
        np.testing.assert_allclose(backend.logits(rows[s]), expected[s][1], atol=1e-4, rtol=0)
    samplers = {s: backend.new_sampler(GREEDY, prompts[s]) for s in range(3)}
    out: dict[int, list[int]] = {0: [], 1: [], 2: []}
    pos = {s: len(prompts[s]) for s in range(3)}
    joined = False
    while any(len(out[s]) < steps for s in range(3)):
        for s, row in rows.items():
            out[s].append(samplers[s].sample(row).token)
        batch, rows = [], {}
        for s in range(3):
            if s == 2 and not joined:
                continue
            if len(out[s]) < steps:
                rows[s] = len(batch)
                batch.append(BatchToken(out[s][-1], s, pos[s], True))
                pos[s] += 1
        if not joined:
            rows[2] = len(batch) + len(prompts[2]) - 1
            batch += prompt_batch(prompts[2], 2)
            joined = True
            backend.decode(batch)
            np.testing.assert_allclose(backend.logits(rows[2]), expected[2][1], atol=1e-4, rtol=0)
            continue
        if batch:
            backend.decode(batch)
    for s in range(3):
        assert out[s] == expected[s][0], f"sequence {s} diverged"


def test_bare_loop_matches_backend_greedy(backend):
    prompts = [backend.tokenize(p) for p in PROMPTS]
    expected = [_alone(backend, p, 5)[0] for p in prompts]
    result = greedy_bare_loop(backend, prompts, 5)
    assert result.tokens == expected
    assert result.decode_tokens == 4 * 3 and result.decode_tokens_per_s > 0


def test_decode_arrays_equals_decode(backend):
    tokens = backend.tokenize(PROMPTS[0])
    backend.decode(prompt_batch(tokens, 0))
    a = backend.logits(len(tokens) - 1)
    backend.kv_clear()
    n = len(tokens)
    backend.decode_arrays(tokens, [3] * n, list(range(n)), [0] * (n - 1) + [1])
    np.testing.assert_array_equal(backend.logits(n - 1), a)


def test_decode_over_n_batch_raises_before_llama_cpp(backend):
    too_many = [BatchToken(100, 0, i) for i in range(backend.n_batch + 1)]
    with pytest.raises(ValueError, match="n_batch"):
        backend.decode(too_many)
    assert backend.kv_pos_max(0) == -1
    # Exactly n_batch is fine, and the backend keeps working.
    backend.decode([BatchToken(100, 0, i, i == backend.n_batch - 1) for i in range(backend.n_batch)])
    assert backend.kv_pos_max(0) == backend.n_batch - 1


@pytest.mark.parametrize(
    "batch, match",
    [
        ([], "empty"),
        ([BatchToken(1, 8, 0)], "sequence id"),
        ([BatchToken(1, -1, 0)], "sequence id"),
        ([BatchToken(49152, 0, 0)], "token id"),
        ([BatchToken(-5, 0, 0)], "token id"),
        ([BatchToken(1, 0, -1)], "position"),
    ],
)
def test_invalid_batches_raise_value_error(backend, batch, match):
    with pytest.raises(ValueError, match=match):
        backend.decode(batch)


def test_position_gap_is_a_backend_error_not_a_crash(backend):
    backend.decode(prompt_batch([504, 3575], 0))
    with pytest.raises(BackendError):
        backend.decode([BatchToken(282, 0, 5, True)])  # positions must continue at 2
    assert backend.kv_pos_max(0) == 1
    backend.decode([BatchToken(282, 0, 2, True)])
    assert backend.kv_pos_max(0) == 2


def test_aborted_decode_rolls_back_processed_micro_batches(smollm2_gguf):
    # llama_decode returns 2 when aborted and keeps the micro-batches it finished; decode() must
    # drop them so the scheduler can treat the whole batch as not run.
    with load(smollm2_gguf, n_ctx=2048, n_seq_max=2, n_batch=1024) as b:
        assert b.n_ubatch == 512
        polls, limit = [0], [10**9]

        @llama_cpp.ggml_abort_callback
        def abort(_data):
            polls[0] += 1
            return polls[0] > limit[0]

        llama_cpp.llama_set_abort_callback(b.ctx, abort, None)
        other = b.tokenize(PROMPTS[0])
        b.decode(prompt_batch(other, 1))  # one micro-batch: counts the abort polls it takes
        reference = b.logits(len(other) - 1)
        polls[0], limit[0] = 0, polls[0] + 10  # abort early in the second micro-batch
        with pytest.raises(BackendError, match="code 2"):
            b.decode([BatchToken(100 + i % 50, 0, i) for i in range(700)])
        assert polls[0] > limit[0]
        assert b.kv_pos_max(0) == -1  # the first 512 tokens were computed, then rolled back
        assert b.kv_pos_max(1) == len(other) - 1  # other sequences untouched
        limit[0] = 10**9
        b.kv_remove(1, len(other) - 1)
        b.decode(prompt_batch(other[-1:], 1, start=len(other) - 1))
        np.testing.assert_allclose(b.logits(0), reference, atol=1e-4, rtol=0)


def test_interrupt_stops_an_interruptible_decode_from_another_thread(smollm2_gguf):
    # The batch lane's long steps give way to an arriving request this way (Scheduler.execute):
    # interrupt() from another thread stops the decode within a graph node, nothing of the batch is
    # kept, and the same batch run again gives the logits it gives uninterrupted.
    with load(smollm2_gguf, n_ctx=4096, n_seq_max=2, n_batch=512, kv_unified=False, flash_attention=False) as b:
        assert b.capabilities.interruptible
        long = [BatchToken(100 + i % 50, 0, i, i == 399) for i in range(400)] + [BatchToken(7, 1, 0, True)]
        started = time.perf_counter()
        b.decode(long)
        full_s = time.perf_counter() - started
        reference = b.logits(399).copy()
        b.kv_clear()

        timer = threading.Timer(full_s / 4, b.interrupt)
        timer.start()
        started = time.perf_counter()
        with pytest.raises(DecodeInterrupted):
            b.decode(long, interruptible=True)
        stopped_s = time.perf_counter() - started
        timer.join()
        assert stopped_s < full_s * 3 / 4  # it stopped, rather than ran to its end
        assert (b.kv_pos_max(0), b.kv_pos_max(1)) == (-1, -1)  # nothing kept
        with pytest.raises(DecodeInterrupted):  # still set: the next interruptible decode stops too
            b.decode(long, interruptible=True)
        b.decode(long)  # an uninterruptible one ignores it
        np.testing.assert_array_equal(b.logits(399), reference)
        b.kv_clear()
        b.clear_interrupt()
        b.decode(long, interruptible=True)
        np.testing.assert_array_equal(b.logits(399), reference)


def test_logits_only_for_rows_that_asked(backend):
    tokens = backend.tokenize(PROMPTS[0])
    backend.decode(prompt_batch(tokens, 0))
    sampler = backend.new_sampler(GREEDY, tokens)
    with pytest.raises(ValueError, match="no logits"):
        sampler.sample(0)
    with pytest.raises(ValueError, match="no logits"):
        sampler.sample(len(tokens))
    token = sampler.sample(len(tokens) - 1).token
    backend.decode([BatchToken(token, 0, len(tokens), False)])
    with pytest.raises(ValueError, match="no logits"):  # the previous decode's rows are gone
        sampler.sample(len(tokens) - 1)


def test_kv_full_raises_and_keeps_nothing(smollm2_gguf):
    with load(smollm2_gguf, n_ctx=256, n_seq_max=2, n_batch=256) as small:
        assert small.n_ctx == 256
        small.decode([BatchToken(100 + i % 50, 0, i, i == 199) for i in range(200)])
        with pytest.raises(KVFullError):
            small.decode([BatchToken(100, 1, i) for i in range(100)])
        assert small.kv_pos_max(1) == -1
        assert small.kv_pos_max(0) == 199
        # Room for 56 more cells: the scheduler's retry with a smaller batch succeeds.
        small.decode([BatchToken(100, 1, i, i == 49) for i in range(50)])
        assert small.kv_pos_max(1) == 49
        small.logits(49)


@pytest.fixture(scope="module")
def exact(smollm2_gguf):
    b = load(smollm2_gguf, exact=True)
    yield b
    b.close()


def test_kv_copy_shares_the_prefix_cells_in_the_pool(exact):
    """kv_copy in the unified pool adds the target sequence to the prefix's cells: continuing the
    copy equals a sequence that prefilled the prefix itself into the same cells. The reference keeps
    the cell layout (prefix, two masked cells, tail) because the pool's logits depend on where a
    sequence's cells sit, even with exact attention (LlamaCppBackend.load); without the prefix
    seen, the logits would move by whole units."""
    backend = exact
    tokens = backend.tokenize(PROMPTS[1])
    n, k = len(tokens), len(tokens) // 2
    backend.kv_clear()
    backend.decode(prompt_batch(tokens[:k], 5))
    backend.decode(prompt_batch([504, 3575], 1, start=k))  # two cells seq 5 must not see
    backend.decode(prompt_batch(tokens[k:], 5, start=k))
    reference = backend.logits(n - k - 1)

    backend.kv_clear()
    backend.decode(prompt_batch(tokens[:k] + [504, 3575], 0))  # shares only the first k tokens
    backend.kv_copy(0, 5, 0, k)
    assert (backend.kv_pos_min(5), backend.kv_pos_max(5)) == (0, k - 1)
    backend.decode(prompt_batch(tokens[k:], 5, start=k))
    np.testing.assert_array_equal(backend.logits(n - k - 1), reference)
    assert backend.kv_pos_max(0) == k + 1  # the source is untouched


def test_kv_remove_tail_then_redecode(backend):
    tokens = backend.tokenize(PROMPTS[1])
    backend.decode(prompt_batch(tokens, 0))
    reference = backend.logits(len(tokens) - 1)
    backend.kv_remove(0, 4, -1)
    assert backend.kv_pos_max(0) == 3
    backend.decode(prompt_batch(tokens[4:], 0, start=4))
    np.testing.assert_allclose(backend.logits(len(tokens) - 5), reference, atol=1e-4, rtol=0)


def test_kv_ops_reject_bad_sequence_ids(backend):
    for call in (
        lambda: backend.kv_remove(8),
        lambda: backend.kv_remove(-1),
        lambda: backend.kv_copy(0, 99, 0, 1),
        lambda: backend.kv_pos_max(1000),
    ):
        with pytest.raises(ValueError, match="sequence id"):
            call()


# --- tokenizer ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "emoji 🦙🚀 and flags 🇫🇷", "中文分词测试，日本語のテキスト", "naïve café", "  spaces\n\ttabs  "],
)
def test_tokenize_round_trip(backend, text):
    tokens = backend.tokenize(text, add_special=False)
    assert b"".join(backend.token_to_bytes(t) for t in tokens) == text.encode("utf-8")


def test_multibyte_characters_split_across_tokens(backend):
    tokens = backend.tokenize("🦙", add_special=False)
    pieces = [backend.token_to_bytes(t) for t in tokens]
    assert len(pieces) > 1  # one character over several tokens: callers must decode incrementally
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")


def test_tokenize_retries_when_text_needs_more_tokens_than_guessed(backend):
    text = "1234567890" * 100 + "🦙中文" * 50  # digits are one byte, one token each
    tokens = backend.tokenize(text, add_special=False)
    assert len(tokens) > len(text.encode()) // 2
    assert text_of(backend, tokens) == text


def test_special_tokens(backend):
    tokens = backend.tokenize("<|im_start|>user\nhi<|im_end|>", add_special=False, parse_special=True)
    assert tokens[0] == 1 and tokens[-1] == 2
    assert backend.token_to_bytes(1) == b""
    assert backend.token_to_bytes(1, special=True) == b"<|im_start|>"
    assert backend.tokenize("<|im_start|>", add_special=False, parse_special=False) != [1]
    assert backend.is_eog(2) and backend.is_eog(0)
    assert not backend.is_eog(tokens[1])
    with pytest.raises(ValueError):
        backend.token_to_bytes(49152)


def test_lone_surrogate_and_empty_text(backend):
    assert backend.tokenize("a\ud800b", add_special=False)
    assert backend.tokenize("", add_special=False) == []


# --- loading, logging, lifecycle ------------------------------------------------------------------
def test_missing_model_file(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        LlamaCppBackend.load(tmp_path / "nope.gguf", n_ctx=256, n_seq_max=1, n_batch=64)
    assert str(tmp_path) not in str(e.value)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(GGUFError) as e:
        LlamaCppBackend.load(bad, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=THREADS)
    assert str(tmp_path) not in str(e.value)
    assert "bad.gguf" in str(e.value)


def test_bad_context_arguments(smollm2_gguf):
    with pytest.raises(ValueError):
        LlamaCppBackend.load(smollm2_gguf, n_ctx=256, n_seq_max=0, n_batch=64)
    with pytest.raises(ValueError):
        LlamaCppBackend.load(smollm2_gguf, n_ctx=256, n_seq_max=1000, n_batch=64)


def test_llama_cpp_logs_go_to_logging_not_the_terminal(smollm2_gguf, capfd, caplog):
    with caplog.at_level(logging.DEBUG, logger="localserve.llama"):
        b = load(smollm2_gguf, n_ctx=256, n_seq_max=1, n_batch=64)
        b.close()
    out, err = capfd.readouterr()
    assert "llama_model_loader" not in err and "llama_context" not in err and not out
    records = [r for r in caplog.records if r.name == "localserve.llama"]
    assert any("llama_context" in r.getMessage() for r in records)
    assert all(not r.getMessage().endswith("\n") for r in records)


def test_close_is_idempotent_and_final(smollm2_gguf):
    b = load(smollm2_gguf, n_ctx=256, n_seq_max=1, n_batch=64)
    b.close()
    b.close()
    with pytest.raises(BackendError):
        b.decode([BatchToken(1, 0, 0, True)])
    with pytest.raises(BackendError):
        b.kv_pos_max(0)


# --- embeddings ----------------------------------------------------------------------------------
def _cos(a, b):
    return float(np.dot(a, b))


def test_embeddings_normalised_deterministic_batched(backend):
    texts = ["The cat sits on the mat.", "A cat is sitting on a mat.", "Quarterly revenue grew by ten percent."]
    inputs = [backend.tokenize(t) for t in texts]
    together = np.array(backend.embed(inputs))
    assert together.shape == (3, backend.info.n_embd)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(np.array(backend.embed(inputs)), together)
    for i, tokens in enumerate(inputs):
        np.testing.assert_allclose(backend.embed([tokens])[0], together[i], atol=1e-5)
    assert _cos(together[0], together[1]) > _cos(together[0], together[2])
    assert _cos(together[0], together[1]) > _cos(together[1], together[2])
    assert backend.kv_pos_max(0) == -1  # the generation cache was not touched


def test_embedding_longer_than_a_batch_equals_single_decode(backend, smollm2_gguf):
    tokens = backend.tokenize("word " * 700)[:700]
    chunked = backend.embed([tokens, tokens[:10]])  # n_batch 512: the long input spans two decodes
    with load(smollm2_gguf, n_ctx=1024, n_seq_max=2, n_batch=1024) as wide:
        whole = wide.embed([tokens, tokens[:10]])
    np.testing.assert_allclose(chunked, whole, atol=1e-4)


def test_embedding_input_errors(backend):
    with pytest.raises(InvalidRequestError):
        backend.embed([[1, 2], []])
    with pytest.raises(ContextLengthExceededError):
        backend.embed([[100] * (backend.n_ctx + 1)])
    with pytest.raises(InvalidRequestError):
        backend.embed([[49152]])
    assert backend.embed([]) == []


# --- per-sequence KV streams (kv_unified=False) -------------------------------------------------
STREAM_PROMPTS = PROMPTS + ["Hello", "def fib(n):", "The quick brown fox jumps over the lazy dog. " * 6, "Why?"]


@pytest.fixture(scope="module")
def streams(smollm2_gguf):
    # As the product loads models: one KV stream per sequence, flash attention off.
    b = load(smollm2_gguf, n_ctx=8 * 256, n_seq_max=8, kv_unified=False, flash_attention=False)
    yield b
    b.close()


def _greedy_steps(backend, prompts: dict[int, list[int]], n: int) -> dict[int, list[np.ndarray]]:
    """Prefill all prompts in one batch, then decode them side by side; logits per step per seq."""
    for seq in range(backend.n_seq_max):
        backend.kv_remove(seq)
    batch = [bt for seq, tokens in prompts.items() for bt in prompt_batch(tokens, seq)]
    pos = {seq: len(tokens) for seq, tokens in prompts.items()}
    rows: dict[int, list[np.ndarray]] = {seq: [] for seq in prompts}
    for _ in range(n):
        backend.decode(batch)
        row_of = {bt.seq_id: i for i, bt in enumerate(batch) if bt.logits}
        batch = []
        for seq in prompts:
            logits = backend.logits(row_of[seq])
            rows[seq].append(logits)
            batch.append(BatchToken(int(np.argmax(logits)), seq, pos[seq], True))
            pos[seq] += 1
    return rows


def test_streams_give_bit_identical_logits_batched_and_alone(streams):
    # The unified pool fails this (greedy tokens flip for some prompts, measured with exact attention
    # too): attention sums over cells interleaved with other sequences' cells.
    prompts = {seq: streams.tokenize(text) for seq, text in enumerate(STREAM_PROMPTS)}
    together = _greedy_steps(streams, prompts, 12)
    for seq, tokens in prompts.items():
        alone = _greedy_steps(streams, {seq: tokens}, 12)[seq]
        for a, b in zip(alone, together[seq]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("source_tail", [2, 150], ids=["cells", "whole-stream"])
def test_streams_kv_copy_prefix_equals_recompute(streams, monkeypatch, source_tail):
    """A source under half a stream is copied cell by cell (seq_copy.py), a longer one as the whole
    stream; either way the copy, cut at k, continues exactly as a recomputed prompt does."""
    from localserve.backends.llamacpp import seq_copy

    cell_copies = []
    real_copy = seq_copy.copy_cells
    monkeypatch.setattr(seq_copy, "copy_cells", lambda *a: cell_copies.append(a) or real_copy(*a))
    streams.kv_clear()
    tokens = streams.tokenize(PROMPTS[1])
    n, k = len(tokens), len(tokens) // 2
    streams.decode(prompt_batch(tokens, 2))
    reference = streams.logits(n - 1)
    streams.decode(prompt_batch(tokens[:k] + [504, 3575] * (source_tail // 2), 0))
    streams.kv_copy(0, 5, 0, k)  # all of the source, then the tail past k dropped
    assert len(cell_copies) == (k + source_tail < streams.n_ctx_seq // 2)
    assert (streams.kv_pos_min(5), streams.kv_pos_max(5)) == (0, k - 1)
    streams.decode(prompt_batch(tokens[k:], 5, start=k))
    np.testing.assert_array_equal(streams.logits(n - k - 1), reference)
    assert streams.kv_pos_max(0) == k + source_tail - 1
    with pytest.raises(ValueError, match="from position 0"):
        streams.kv_copy(0, 6, 1, k)


def test_streams_bound_each_sequence_not_the_pool(streams):
    assert streams.n_ctx_seq == 256
    streams.kv_clear()
    streams.decode(prompt_batch([504] * 200, 0))
    streams.decode(prompt_batch([504] * 200, 1))  # the pool has room for both: streams are separate
    with pytest.raises(KVFullError):
        streams.decode(prompt_batch([504] * 100, 0, start=200))
    assert streams.kv_pos_max(0) == 199


def test_streams_prompt_chunks_beside_decodes_equal_each_alone(streams):
    """A step mixing a decode with prompt chunks: llama.cpp alone would compute the first token of
    seq 1's chunk in a micro-batch with seq 0's decode and its last token in one of its own: each
    time as the only row of seq 1 (other kernels, other rounding: its logits moved by ~0.4). The
    backend submits the batch so that every row equals the same sequence run alone."""
    prompt_a, prompt_b = streams.tokenize(PROMPTS[1]) * 2, streams.tokenize(PROMPTS[0])
    first = streams.tokenize(PROMPTS[2])

    def alone(seq_id: int, tokens: list[int], start: int = 0) -> np.ndarray:
        streams.decode(prompt_batch(tokens, seq_id, start))
        return streams.logits(len(tokens) - 1)

    streams.kv_clear()
    ref_a = alone(1, prompt_a)
    ref_b = alone(2, prompt_b)
    alone(0, first)
    ref_decode = alone(0, [504], start=len(first))

    streams.kv_clear()
    streams.decode(prompt_batch(first, 0))
    cut = len(prompt_a) - 2
    streams.decode(prompt_batch(prompt_a[:cut], 1))
    batch = [BatchToken(504, 0, len(first), True), *prompt_batch(prompt_a[cut:], 1, start=cut),
             *prompt_batch(prompt_b, 2)]
    streams.decode(batch)
    rows = {bt.seq_id: i for i, bt in enumerate(batch) if bt.logits}
    np.testing.assert_array_equal(streams.logits(rows[0]), ref_decode)
    np.testing.assert_array_equal(streams.logits(rows[1]), ref_a)
    np.testing.assert_array_equal(streams.logits(rows[2]), ref_b)
    assert not streams.logits_row(rows[1]).flags.writeable
    with pytest.raises(ValueError, match="no logits"):
        streams.logits_row(1)


def test_streams_kv_full_in_a_later_call_keeps_nothing_of_the_batch(streams):
    streams.kv_clear()
    streams.decode(prompt_batch([504] * 200, 1))
    # seq 0's chunk goes first and fits; seq 1's overflows its 256-cell stream.
    with pytest.raises(KVFullError):
        streams.decode(prompt_batch([504] * 30, 0) + prompt_batch([504] * 80, 1, start=200))
    assert streams.kv_pos_max(0) == -1 and streams.kv_pos_max(1) == 199
