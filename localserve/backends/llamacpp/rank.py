"""A reranker's relevance scores on a llama.cpp context of its own, with the model's rank pooling.

llama.cpp's rank pooling runs the GGUF's classification head (`cls*` tensors) on one token per
sequence: the last for Qwen3 rerankers, the first (CLS) for BERT-style ones. llama-server takes
the first output as the score (send_rerank: `embd[0]`; for Qwen3-Reranker the softmax of "yes"
over "no"), and so does this.

A causal model reads its pairs as embeddings are read (embed_pooling's decode_plan): pieces of at
most one micro-batch per decode, the KV cells carrying a long pair across decodes; a pair's score
is read after the decode that holds its last token (its value after any earlier piece is the
score of a prefix, and is ignored). Splitting that way changes nothing: a 714-token pair scored
0.6180697679519653 in one micro-batch of 4,096 and in pieces of 512 alike. A larger micro-batch
would cost memory for nothing: the compute buffer grows with it (SmolLM2, 49k vocabulary: 99 MiB at
512, 401 MiB at 2,048, 1,682 MiB at 8,192 tokens).

A non-causal model (BERT-style, no KV cache: llama.cpp encodes each decode whole and aborts the
process when a decode is longer than its micro-batch) gets whole pairs per decode, each pair at
most ENCODER_PAIR_TOKENS.
"""

from __future__ import annotations

import threading
from typing import Generator, Sequence

import llama_cpp

from ...errors import BackendError, ContextLengthExceededError, InvalidRequestError
from ..common.embed_pooling import decode_plan, group_inputs
from .batch import PackedBatch
from .embed import pooled_context

DECODE_TOKENS = 512  # a causal model's micro-batch, and so its tokens per decode
ENCODER_PAIR_TOKENS = 2048  # a non-causal model's longest pair (its whole micro-batch)


class RankContext:
    def __init__(self, model, *, n_ctx_seq: int, n_seq_max: int, n_threads: int, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.n_seq_max = n_seq_max
        self.ctx = self._context(model, n_ctx_seq, min(n_ctx_seq, DECODE_TOKENS), n_threads)
        self._mem = llama_cpp.llama_get_memory(self.ctx)
        if self._mem:
            self.n_cells, self.n_batch = n_ctx_seq, min(n_ctx_seq, DECODE_TOKENS)
        else:  # no KV cache: an encoder, which decodes whole pairs only
            llama_cpp.llama_free(self.ctx)
            self.n_cells = self.n_batch = min(n_ctx_seq, ENCODER_PAIR_TOKENS)
            self.ctx = self._context(model, self.n_cells, self.n_cells, n_threads)
        if llama_cpp.llama_pooling_type(self.ctx) != llama_cpp.LLAMA_POOLING_TYPE_RANK:
            self.close()
            raise InvalidRequestError("this model is not a reranker (its GGUF has no rank pooling)", param="model")
        self._batch = PackedBatch(self.n_batch)
        self._lock = threading.Lock()  # one group at a time

    def _context(self, model, n_cells: int, n_batch: int, n_threads: int):
        # Every decode is one micro-batch (n_ubatch = n_batch): an encoder's must be, and a causal
        # model's pieces are sized to one already.
        # The model's own pooling (forcing rank would run any model's hidden state as a "score"):
        # the check after this refuses a GGUF whose pooling is not rank.
        return pooled_context(model, n_ctx=n_cells, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=self.n_seq_max,
                              n_threads=n_threads, what="rerank")

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def set_threads(self, n: int) -> None:
        if self.ctx:
            llama_cpp.llama_set_n_threads(self.ctx, n, n)

    def score_steps(self, inputs: Sequence[Sequence[int]]) -> Generator[bool, None, list[float]]:
        """Each input's score, one decode per `next()` (PooledEmbedder.embed_steps' protocol: True
        after a group, when nothing of this call is left in the context)."""
        self._check(inputs)
        scores = [0.0] * len(inputs)
        for group in group_inputs(inputs, self.n_cells, self.n_seq_max):
            with self._lock:
                if not self.ctx:
                    raise BackendError("the rerank context is closed")
                try:
                    for pieces, owners, n in decode_plan(inputs, group, self.n_batch):
                        self._decode(pieces)
                        for (tokens, seq, pos), (idx, _, _) in zip(pieces, owners):
                            if pos + len(tokens) == len(inputs[idx]):  # its last token: the score
                                scores[idx] = self._score(seq)
                        yield False
                finally:
                    if self._mem:
                        llama_cpp.llama_memory_clear(self._mem, True)
            yield True
        return scores

    def _check(self, inputs: Sequence[Sequence[int]]) -> None:
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise InvalidRequestError(f"pair {i} is empty", param="documents")
            if len(tokens) > self.n_cells:
                raise ContextLengthExceededError(
                    f"document {i} makes a pair of {len(tokens)} tokens with the query; this model ranks "
                    f"at most {self.n_cells}", param="documents")
            if min(tokens) < 0 or max(tokens) >= self.n_vocab:
                raise InvalidRequestError(f"pair {i} has a token id outside the vocabulary", param="documents")

    def _decode(self, pieces) -> None:
        n = 0
        for tokens, seq, pos in pieces:
            n = self._batch.fill_sequence(tokens, seq, pos, offset=n, all_logits=True)
        rc = llama_cpp.llama_decode(self.ctx, self._batch.struct)
        if rc != 0:
            raise BackendError(f"rerank decode failed (code {rc})")

    def _score(self, seq: int) -> float:
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, seq)
        if not ptr:
            raise BackendError("the rerank context produced no score")
        return float(ptr[0])
