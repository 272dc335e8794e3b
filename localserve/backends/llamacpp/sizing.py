"""llama.cpp's rules for sizing its KV cache (LlamaCppBackend.plan_kv), from the engine's KVRequest.

- Streams or unified. One KV stream per sequence id (n_ctx = ids x cells per stream, exact answers:
  no other sequence's cells in a sequence's attention, and f16 without flash attention) where every
  running and parked id gets a full-length f16 stream; else one unified pool, q8_0 with flash
  attention, which holds twice the cells. Shrinking requests or concurrency to keep exactness is
  the wrong trade for a desktop: an 8B model on 16 GB would get 4 x 2,816 tokens, the pool gives
  it 8,192 x 5.
- 256-cell padding: llama.cpp pads its cache to 256 cells, so a pool is a multiple of 256 (the
  budget rounded down, one request's context up) and so is a stream.
- Sequence ids: at most 256 (llama.cpp refuses a context with more), so at most 128 running with
  as many parked prefix-cache ids. Consecutive ids are a rule of the running engine, declared by
  the loaded backend (Capabilities.consecutive_ids, batching/kvpool.py).
"""

from __future__ import annotations

import math

from ...config.kv_cache import kv_element_bytes, needs_flash_attention
from ..base import KVRequest, KVSizing, seq_ids_for

LLAMA_MAX_SEQ = 256  # llama.cpp refuses contexts with more sequence ids
_PAD = 256  # llama.cpp pads its KV cache to this many cells
_MIN_STREAM = 2048  # below this, run fewer sequences rather than cramp every request's stream


def plan_kv(want: KVRequest) -> KVSizing:
    # With as many parked prefix-cache ids the total stays within llama.cpp's limit.
    max_sequences = min(want.max_sequences, LLAMA_MAX_SEQ // 2)
    n_ctx_seq = want.n_ctx_seq

    def ids(n: int) -> int:
        return min(LLAMA_MAX_SEQ, seq_ids_for(n, want.prefix_cache))

    layout = want.layout
    if layout == "auto":
        # A type the model was given (model_kv_cache_type) counts at its own size: q8_0 streams
        # fit where f16 ones would not.
        token_bytes = want.kv_bytes_per_token * (1 if want.kv_type == "auto" else kv_element_bytes(want.kv_type) / 2)
        fits = ids(max_sequences) * n_ctx_seq * token_bytes <= want.kv_budget_bytes
        layout = "streams" if fits else "unified"
    unified = layout == "unified"
    kv_type = want.kv_type
    if kv_type == "auto":
        # q8_0 V needs flash attention, whose CPU kernel rounds by chunk size: only where the
        # unified pool gave exactness up anyway. Half the bytes, so twice the cells.
        kv_type = "q8_0" if unified else "f16"
    cell_bytes = max(1, math.ceil(want.kv_bytes_per_token * kv_element_bytes(kv_type) / 2))
    cells = want.kv_budget_bytes // cell_bytes
    # In a unified pool flash attention is what keeps attention per sequence: its CPU kernel skips
    # the other sequences' masked cells, and its scratch does not grow with the pool (without it,
    # a micro-batch x pool x heads score matrix). A quantized V needs it in any layout (llama.cpp
    # refuses the context without); a quantized K alone does not, so streams stay exact with it.
    flash_attention = want.flash_attention or unified or needs_flash_attention(kv_type)
    if unified:
        # Room for every running request at full length, within the budget, and never below one.
        n_ctx = max(n_ctx_seq, min(max_sequences * n_ctx_seq, cells // _PAD * _PAD))
        n_ctx = -(-n_ctx // _PAD) * _PAD
        return KVSizing(n_ctx=n_ctx, n_ctx_seq=n_ctx_seq, max_sequences=max_sequences, kv_unified=True,
                        kv_type=kv_type, flash_attention=flash_attention)
    # One stream of n_ctx_seq cells per sequence id: llama.cpp needs n_ctx = streams x cells.
    floor = min(n_ctx_seq, _MIN_STREAM)
    while max_sequences > 1 and cells // ids(max_sequences) < floor:
        max_sequences //= 2
    per_stream = cells // ids(max_sequences)
    n_ctx_seq = max(_PAD, max(floor, min(n_ctx_seq, per_stream)) // _PAD * _PAD)
    return KVSizing(n_ctx=n_ctx_seq * ids(max_sequences), n_ctx_seq=n_ctx_seq, max_sequences=max_sequences,
                    kv_unified=False, kv_type=kv_type, flash_attention=flash_attention)
