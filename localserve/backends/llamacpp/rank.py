"""A reranker's relevance scores on a llama.cpp context of its own, with the model's rank pooling.

llama.cpp's rank pooling runs the GGUF's classification head (`cls*` tensors) on one token per
sequence: the last for Qwen3 rerankers, the first (CLS) for BERT-style ones. llama-server takes
the first output as the score (send_rerank: `embd[0]`; for Qwen3-Reranker the softmax of "yes"
over "no"), and so does this.

One pair per decode, so a pair's score is its own: decoded beside other pairs it changed in the
fourth digit (a group of four: 0.8984 where alone 0.8991), so it would have depended on the other
documents of the request and on the load. A causal model's pair goes through in pieces, as many
tokens a decode as `room` allows (the engine sizes pieces so that chats beside it keep their
pace), the KV cells carrying it across pieces; its score is read after the piece that holds its
last token. With flash attention off the split changes nothing: a 300-token pair scored
0.621684730052948 in pieces of 512, 150, 128, 100, 64 and 37 alike, where with it on the same pair
gave 0.607 to 0.631 (so it is off here, as in the generation context). Pieces never leave a lone
last token (one row takes llama.cpp's GEMV kernels, which round otherwise). A causal model's
micro-batch stays at DECODE_TOKENS: the compute buffer grows with it (SmolLM2, 49k vocabulary:
99 MiB at 512, 401 MiB at 2,048, 1,682 MiB at 8,192 tokens).

A non-causal model (BERT-style, no KV cache: llama.cpp encodes each decode whole and aborts the
process when a decode is longer than its micro-batch) decodes each pair whole, at most
ENCODER_PAIR_TOKENS.
"""

from __future__ import annotations

import threading
from typing import Callable, Generator, Sequence

import llama_cpp

from ...errors import BackendError, ContextLengthExceededError, InvalidRequestError
from .batch import PackedBatch
from .embed import OwnedContext, pooled_context

DECODE_TOKENS = 512  # a causal model's micro-batch, and so its most tokens a decode
ENCODER_PAIR_TOKENS = 2048  # a non-causal model's longest pair (its whole micro-batch)

Room = Callable[[int], int]  # tokens the next decode may take, given the most it could


class RankContext(OwnedContext):
    def __init__(self, model, *, n_ctx_seq: int, n_threads: int, n_vocab: int) -> None:
        self.n_vocab = n_vocab
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
        self._lock = threading.Lock()  # one pair at a time

    @staticmethod
    def _context(model, n_cells: int, n_batch: int, n_threads: int):
        # The model's own pooling (forcing rank would run any model's hidden state as a "score"):
        # the caller refuses a GGUF whose pooling is not rank. Every decode is one micro-batch.
        return pooled_context(model, n_ctx=n_cells, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=1,
                              n_threads=n_threads, what="rerank", flash_attn=llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)

    def score_steps(self, inputs: Sequence[Sequence[int]], room: Room | None = None) -> Generator[bool, None, list[float]]:
        """Each input's score, one decode per `next()` (PooledEmbedder.embed_steps' protocol: True
        after a pair, when nothing of this call is left in the context)."""
        self._check(inputs)
        scores = []
        for tokens in inputs:
            with self._lock:
                if not self.ctx:
                    raise BackendError("the rerank context is closed")
                try:
                    pos = 0
                    while pos < len(tokens):
                        take = self._piece(len(tokens) - pos, room)
                        self._decode(tokens[pos:pos + take], pos)
                        pos += take
                        if pos < len(tokens):
                            yield False
                    scores.append(self._score())
                finally:
                    if self._mem:
                        llama_cpp.llama_memory_clear(self._mem, True)
            yield True
        return scores

    def _piece(self, left: int, room: Room | None) -> int:
        if not self._mem:
            return left  # an encoder: whole (within n_batch, _check says)
        take = min(left, self.n_batch, max(2, room(self.n_batch) if room else self.n_batch))
        if left - take == 1:  # never a lone last row
            take = take + 1 if take < self.n_batch else take - 1
        return take

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

    def _decode(self, tokens: Sequence[int], pos: int) -> None:
        self._batch.fill_sequence(tokens, 0, pos, all_logits=True)
        rc = llama_cpp.llama_decode(self.ctx, self._batch.struct)
        if rc != 0:
            raise BackendError(f"rerank decode failed (code {rc})")

    def _score(self) -> float:
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not ptr:
            raise BackendError("the rerank context produced no score")
        return float(ptr[0])
