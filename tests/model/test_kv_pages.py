"""KV memory follows what the cache holds (backends/llamacpp/kv_pages.py, issue 42): the product's
context of 16 streams x 8,192 cells commits no KV page at load, a sequence's cells land only in its
own stream's slices, and its pages go back to the OS once it has stayed empty a few seconds. RSS is read from /proc;
memory held, never time."""

from __future__ import annotations

import time

import numpy as np
import pytest

from localserve.backends.llamacpp import kv_pages
from localserve.backends.llamacpp.backend import LlamaCppBackend
from worker_locks import THREADS

pytestmark = pytest.mark.model
MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


@pytest.fixture(scope="module")
def product_sized(smollm2_gguf):
    if not kv_pages.available():
        pytest.skip("KV pages go back to the OS on Linux only")
    before = rss_bytes()
    b = LlamaCppBackend.load(smollm2_gguf, n_ctx=16 * 8192, n_seq_max=16, n_batch=512, n_threads=1,
                             kv_unified=False, flash_attention=False)
    yield b, before
    b.close()


def test_a_loaded_context_commits_no_kv_page_and_a_freed_stream_gives_its_pages_back(product_sized):
    b, before = product_sized
    pages = b._pages.pages
    assert pages.size == 30 * 16 * 2 * 8192 * 384  # SmolLM2: 30 layers, 16 streams, f16 K and V rows
    # The KV buffer itself, then the whole load: the process's own RSS is not the figure, since in a
    # full test session it already holds what earlier tests loaded (2.1 GB in CI).
    assert kv_pages.resident_bytes(pages.address, pages.size) < 8 * MIB
    assert rss_bytes() - before < 600 * MIB  # was 3 GiB: the clear at load wrote every page
    tokens = b.tokenize("hello world " * 250)[:500]
    b.decode_arrays(tokens, [3] * 500, list(range(500)), [0] * 499 + [1])
    inside = sum(kv_pages.resident_bytes(a, n) for a, n in pages.stream_ranges(3))
    outside = kv_pages.resident_bytes(pages.address, pages.size) - inside
    assert inside > 20 * MIB and outside <= 2 * 30 * 2 * kv_pages.PAGE  # only pages shared at slice edges
    held = rss_bytes()
    b.kv_remove(3)
    # Kept while a busy engine may reuse the stream at once (writing given-back pages again costs
    # faults: kv_pages.StreamKeeper), given back once it has stayed empty for HOLD_S.
    now = time.monotonic()
    assert b.release_idle_memory(now) == pytest.approx(kv_pages.StreamKeeper.HOLD_S, abs=1.0)
    assert rss_bytes() > held - inside // 4
    assert b.release_idle_memory(now + kv_pages.StreamKeeper.HOLD_S) is None
    assert rss_bytes() < held - inside * 3 // 4  # the stream's pages went back
    b.kv_clear()


@pytest.mark.timeout(900)  # one 8,191-token prefill: ~10 s on 2 quiet cores, minutes on a shared machine
def test_eight_sequences_of_the_full_context_fit_at_once_and_answer_alike(product_sized):
    """Today's capacity with KV that commits as it is used (issue 42 part 1): eight sequences of
    SmolLM2's whole 8,192-token context resident together, each answering its next token. The
    prompt is computed once; the other seven get its cells as the prompt cache on disk places a
    saved conversation (SeqState), so the test pays one 8,191-token prefill, not eight."""
    from localserve.backends.llamacpp.seq_state import SeqState

    b, _ = product_sized
    n, step = 8191, 512
    tokens = b.tokenize("The quick brown fox jumps over the lazy dog near the river bank. " * 700)[:n]
    assert len(tokens) == n
    b.kv_clear()
    b.set_threads(THREADS)
    try:
        for start in range(0, n, step):
            chunk = tokens[start:start + step]
            b.decode_arrays(chunk, [0] * len(chunk), list(range(start, start + len(chunk))), [0] * len(chunk))
        state = SeqState(b).save(0)
        for seq in range(1, 8):
            SeqState(b).restore(seq, state, keep=n)
        pages = b._pages.pages
        stream_bytes = 30 * 2 * 8192 * 384  # SmolLM2's f16 K and V rows of one full stream
        assert kv_pages.resident_bytes(pages.address, pages.size) > 8 * stream_bytes * 0.95
        # Each one's last cell: the same next token in every sequence, computed in one batch.
        b.decode_arrays([tokens[-1]] * 8, list(range(8)), [n] * 8, [1] * 8)
        rows = [b.logits(i) for i in range(8)]
        assert all(np.array_equal(rows[0], row) for row in rows[1:])
        assert all(b.kv_pos_max(seq) == n for seq in range(8))
    finally:
        b.set_threads(1)
        b.kv_clear()
    assert kv_pages.resident_bytes(pages.address, pages.size) < 8 * MIB  # all of it given back
