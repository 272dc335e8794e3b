"""Embeddings on a llama.cpp context of their own (pooling and grouping: embed_pooling.py).

A separate context keeps embedding requests from touching the generation KV cache or its logits
(an embeddings context outputs every token, which a generation step must not pay for).
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from ...errors import BackendError, InvalidRequestError
from ..common.embed_pooling import Piece, PooledEmbedder
from .batch import PackedBatch


def pooled_context(model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, n_threads: int, what: str,
                   flash_attn: int | None = None):
    """A llama.cpp context that outputs embeddings, pooled as the model says (`what` names it in
    errors), its inputs of any length sharing one pool of n_ctx cells; `flash_attn`: llama.cpp's
    flash_attn_type, None for its default."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch
    params.n_seq_max = n_seq_max
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.embeddings = True
    params.kv_unified = True
    if flash_attn is not None:
        params.flash_attn_type = flash_attn
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise BackendError(f"could not create the {what} context (see log)")
    return ctx


class OwnedContext:
    """A llama.cpp context of its own beside the model's generation context (embeddings, rank):
    freed once, and following the thread count the engine sets."""

    ctx: object

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def set_threads(self, n: int) -> None:
        if self.ctx:
            llama_cpp.llama_set_n_threads(self.ctx, n, n)


class EmbeddingContext(OwnedContext, PooledEmbedder):
    def __init__(self, model, *, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int,
                 n_embd: int, n_vocab: int) -> None:
        # Pooling left to the model's default (NONE for decoder LLMs; forcing NONE explicitly makes
        # llama.cpp log a warning on every load).
        self.ctx = pooled_context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512),
                                  n_seq_max=n_seq_max, n_threads=n_threads, what="embeddings")
        if llama_cpp.llama_pooling_type(self.ctx) != llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # Encoder embedding models (BERT-style: CLS/MEAN pooling, non-causal attention) need whole
            # inputs per micro-batch and their own pooling; averaging chunks here would be wrong.
            # A reranker (rank pooling) lands here too: its answer is /v1/rerank. The caller's 400,
            # not a 500: nothing failed, the model is not one this call can use.
            rank = llama_cpp.llama_pooling_type(self.ctx) == llama_cpp.LLAMA_POOLING_TYPE_RANK
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
            raise InvalidRequestError("this model is a reranker: use /v1/rerank" if rank else
                                      "embedding models with their own pooling are not supported by this backend yet",
                                      param="model")
        super().__init__(n_ctx=llama_cpp.llama_n_ctx(self.ctx), n_batch=llama_cpp.llama_n_batch(self.ctx),
                         n_seq_max=n_seq_max, n_embd=n_embd, n_vocab=n_vocab)
        self._mem = llama_cpp.llama_get_memory(self.ctx)
        self._batch = PackedBatch(self.n_batch)

    def _is_open(self) -> bool:
        return bool(self.ctx)

    def _begin_group(self, cells: int) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def _end_group(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def _decode(self, pieces: list[Piece], n_tokens: int) -> np.ndarray:
        n = 0
        for tokens, seq, pos in pieces:
            n = self._batch.fill_sequence(tokens, seq, pos, offset=n, all_logits=True)
        rc = llama_cpp.llama_decode(self.ctx, self._batch.struct)
        if rc != 0:
            raise BackendError(f"embedding decode failed (code {rc})")
        ptr = llama_cpp.llama_get_embeddings(self.ctx)
        if not ptr:
            raise BackendError("the embeddings context produced no embeddings")
        return np.ctypeslib.as_array(ptr, shape=(n_tokens, self.n_embd))
