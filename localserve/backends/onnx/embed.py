"""Embeddings on the ONNX backend: the converted graph's `embeddings` output (every token's hidden
state after the final norm, llama.cpp's per-token embeddings), pooled as the llama.cpp backend
pools them (embed_pooling.py), so both backends give the same vectors for the same model.

Each group of inputs gets a KV cache of its own, sized to the group's tokens and dropped after it:
the generation pool's slots are the scheduler's books (an embedding holding some between steps
would turn into a KV-full error for a generation step), and a cache the size of the pool would make
every embedding run attend over thousands of empty slots (the graph's attention is O(tokens x slots)).
"""

from __future__ import annotations

import numpy as np

from ...errors import BackendError
from ..common.embed_pooling import Piece, PooledEmbedder
from .kv import SlotTable
from .session import bind_caches

EMBEDDINGS_OUTPUT = "embeddings"
_NO_ROWS = np.zeros(0, dtype=np.int64)


def has_embeddings(session) -> bool:
    """Whether the graph has the embeddings output (converters before it did not)."""
    return any(o.name == EMBEDDINGS_OUTPUT for o in session.get_outputs())


class OnnxEmbedder(PooledEmbedder):
    def __init__(self, session, *, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int, n_batch: int,
                 n_seq_max: int, n_embd: int, n_vocab: int) -> None:
        import onnxruntime as ort

        super().__init__(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, n_embd=n_embd, n_vocab=n_vocab)
        self._ort = ort
        self.session = session
        self._cache_shape = (n_layer, n_head_kv, head_dim)
        self._io = None  # the current group's binding (and through it, its caches)
        self._slots: SlotTable | None = None
        self._caches: list = []
        self._closed = False

    def close(self) -> None:
        self._closed = True

    def _is_open(self) -> bool:
        return not self._closed

    def _begin_group(self, cells: int) -> None:
        n_layer, kv, hd = self._cache_shape
        self._slots = SlotTable(cells, self.n_seq_max)
        self._io = io = self.session.io_binding()

        self._caches = [self._ort.OrtValue.ortvalue_from_numpy(np.zeros((kv, cells, hd), dtype=np.float32))
                        for _ in range(2 * n_layer)]
        bind_caches(io, self._caches)  # written in place, as in decode
        io.bind_cpu_input("logits_idx", _NO_ROWS)  # no LM head rows: embeddings only

    def _end_group(self) -> None:
        self._io, self._slots, self._caches = None, None, []

    def _decode(self, pieces: list[Piece], n_tokens: int) -> np.ndarray:
        assert self._io is not None and self._slots is not None
        tokens = np.fromiter((t for p in pieces for t in p[0]), np.int64, n_tokens)
        seqs = np.concatenate([np.full(len(p[0]), p[1], np.int64) for p in pieces])
        pos = np.concatenate([np.arange(p[2], p[2] + len(p[0]), dtype=np.int64) for p in pieces])
        table, io = self._slots, self._io
        slots = table.plan(n_tokens)  # the group's cache was sized for all its tokens: never full
        io.bind_cpu_input("input_ids", tokens)
        io.bind_cpu_input("positions", pos)
        io.bind_cpu_input("slots", slots)
        io.bind_cpu_input("attn_bias", table.bias(seqs, pos, slots))
        io.bind_output(EMBEDDINGS_OUTPUT, "cpu")
        try:
            self.session.run_with_iobinding(io)
        except Exception as e:  # noqa: BLE001 - ORT's errors carry paths and internals
            raise BackendError(f"embedding run failed in onnxruntime ({type(e).__name__})") from None
        table.commit(seqs, pos, slots)
        return io.get_outputs()[-1].numpy()  # bound last: the caches are bound first
