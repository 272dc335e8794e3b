"""KV memory follows what the cache holds (backends/llamacpp/kv_pages.py, issue 42): the product's
context of 16 streams x 8,192 cells commits no KV page at load, a sequence's cells land only in its
own stream's slices, and its pages go back to the OS when it is removed. RSS is read from /proc;
memory held, never time."""

from __future__ import annotations

import pytest

from localserve.backends.llamacpp import kv_pages
from localserve.backends.llamacpp.backend import LlamaCppBackend

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
    assert rss_bytes() < held - inside * 3 // 4  # the stream's pages went back
    b.kv_clear()
