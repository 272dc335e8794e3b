"""The llama.cpp backend's contexts besides the generation one, each made on first use: embeddings
(embed.py) and a reranker's scores (rank.py). Both follow the backend's thread count.

Each holds one request's worth of cells: with per-sequence streams the generation context's n_ctx
is streams x n_ctx_seq, and a pool that size would double the model's KV memory on the first call.
No input may be longer than n_ctx_seq anyway.
"""

from __future__ import annotations

import threading

from .embed import EmbeddingContext
from .rank import RankContext

_MAX_SEQS = 64  # embeddings inputs one group may hold


class PooledContexts:
    def __init__(self, model, *, n_ctx_seq: int, n_batch: int, n_seq_max: int, n_threads: int, n_embd: int,
                 n_vocab: int) -> None:
        self.model = model
        self.n_ctx_seq, self.n_batch, self.n_seq_max = n_ctx_seq, n_batch, min(n_seq_max, _MAX_SEQS)
        self.n_embd, self.n_vocab = n_embd, n_vocab
        self.threads = n_threads  # set_threads' last count, which a new context starts with
        # [embeddings, rerank]: the backend's finalizer closes what is here (close_all)
        self.contexts: list[EmbeddingContext | RankContext | None] = [None, None]
        self._lock = threading.Lock()

    def embedder(self) -> EmbeddingContext:
        with self._lock:
            if self.contexts[0] is None:
                self.contexts[0] = EmbeddingContext(
                    self.model, n_ctx=self.n_ctx_seq, n_batch=self.n_batch, n_seq_max=self.n_seq_max,
                    n_threads=self.threads, n_embd=self.n_embd, n_vocab=self.n_vocab)
            return self.contexts[0]  # type: ignore[return-value]

    def ranker(self) -> RankContext:
        with self._lock:
            if self.contexts[1] is None:
                self.contexts[1] = RankContext(self.model, n_ctx_seq=self.n_ctx_seq, n_threads=self.threads,
                                               n_vocab=self.n_vocab)
            return self.contexts[1]  # type: ignore[return-value]

    def set_threads(self, n: int) -> None:
        with self._lock:
            self.threads = n
            for context in self.contexts:
                if context is not None:
                    context.set_threads(n)


def close_all(contexts: list) -> None:
    for context in contexts:
        if context is not None:
            context.close()
