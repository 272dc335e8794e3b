"""Copying one sequence's KV cells into another sequence's stream, at the price of the cells it holds.

Why: with a KV stream per sequence (the product's layout, for exact batch invariance) llama.cpp's
`llama_memory_seq_cp` across streams copies the *whole* source stream, every cell whether used or
not, and the copy runs single-threaded at the start of the next `llama_decode`, which also reserves
its worst-case graph again. A stream holds n_ctx / n_seq_max cells; with the KV sized from the
machine's memory that is 8,192 cells (190 MB for SmolLM2) for each of 16 sequences. A prefix-cache
hit on a 24-token chat template so cost an interactive request's first step 35-100 ms, during which
the second compute thread slept (`perf sched` of benchmarks/serve.py --flood, 2026-12-05:
memmove in the engine thread, the OpenMP worker idle).

`llama_state_seq_get_data` / `set_data` move the source's used cells only (their positions and K/V
rows, bit for bit), into free cells of the destination's stream, at once. The result is the same
KV data at the same positions, so outputs do not change (tests/model/test_backend_llamacpp.py compares
logits after both copies). It is used where it is cheaper and exact:
- the source holds less than half a stream (the state copy moves each used cell twice, out to a
  buffer and in; the stream copy moves every cell of the stream once);
- the model has no sliding window (a sequence's state leaves out cells its window masks, which a
  copy truncated at an earlier position would still need) and is neither recurrent nor hybrid (their
  state is not cells).
Everything else, and any failure, takes the stream copy.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

log = logging.getLogger(__name__)


def cell_copy_possible(model: llama_cpp.llama_model_p) -> bool:
    """Whether this model's sequences may be copied cell by cell (see the module docstring)."""
    return (llama_cpp.llama_model_n_swa(model) == 0 and not llama_cpp.llama_model_is_recurrent(model)
            and not llama_cpp.llama_model_is_hybrid(model))


def copy_cells(ctx: llama_cpp.llama_context_p, src: int, dst: int) -> bool:
    """Copy every cell `src` holds into the empty sequence `dst`; False (and `dst` empty) if
    llama.cpp could not, for the caller to take the stream copy instead."""
    size = llama_cpp.llama_state_seq_get_size(ctx, src)
    # calloc: pages of a large buffer are not touched before llama.cpp writes them.
    buffer = (ctypes.c_uint8 * size)()
    if not size or llama_cpp.llama_state_seq_get_data(ctx, buffer, size, src) != size:
        log.warning("could not read sequence %d's KV cells (%d bytes): copying its stream", src, size)
        return False
    # On failure llama.cpp clears what it had placed of dst ("failed to restore kv cache").
    if llama_cpp.llama_state_seq_set_data(ctx, buffer, size, dst) != size:
        log.warning("could not place sequence %d's KV cells in sequence %d: copying the stream", src, dst)
        return False
    return True
