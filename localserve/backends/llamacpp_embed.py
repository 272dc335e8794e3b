"""Embeddings on a context of their own: mean-pooled, L2-normalised, many inputs per decode.

A separate context keeps embedding requests from touching the generation KV cache or its logits
(an embeddings context outputs every token, which a generation step must not pay for).

Pooling is done here in numpy over per-token embeddings (pooling NONE), not by llama.cpp's MEAN
pooling: llama.cpp pools within one decode call, so an input longer than one batch would be pooled
wrongly, and MEAN with n_seq_max > 1 aborted context creation for some models in our research
(GGML_ASSERT in build_pooling). Summing per-token rows across decodes has neither problem.
"""

from __future__ import annotations

import threading
from typing import Generator, Iterator, Sequence

import llama_cpp
import numpy as np

from ..errors import BackendError, ContextLengthExceededError, InvalidRequestError
from .llamacpp_batch import PackedBatch


class EmbeddingContext:
    def __init__(self, model, *, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int,
                 n_embd: int, n_vocab: int) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.embeddings = True
        params.kv_unified = True  # inputs of any length share one pool of n_ctx cells
        # Pooling left to the model's default (NONE for decoder LLMs; forcing NONE explicitly makes
        # llama.cpp log a warning on every load).
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise BackendError("could not create the embeddings context (see log)")
        if llama_cpp.llama_pooling_type(self.ctx) != llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # Encoder embedding models (BERT-style: CLS/MEAN pooling, non-causal attention) need whole
            # inputs per micro-batch and their own pooling; averaging chunks here would be wrong.
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
            raise BackendError("embedding models with their own pooling are not supported by this backend yet")
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.n_seq_max = n_seq_max
        self.n_embd = n_embd
        self.n_vocab = n_vocab
        self._mem = llama_cpp.llama_get_memory(self.ctx)
        self._batch = PackedBatch(self.n_batch)
        self._lock = threading.Lock()  # one embeddings call at a time per context

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        steps = self.embed_steps(inputs)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def embed_steps(self, inputs: Sequence[Sequence[int]]) -> Generator[bool, None, list[list[float]]]:
        """The vectors of `inputs`, one decode (at most n_batch tokens) per `next()`, so the engine
        can run generation steps in between. Yields True after each group of inputs, when the
        context holds nothing of this call (another call may run next), False within a group (its
        KV cells are still needed: nothing else may use this context before the next `next()`).
        Closing the generator early clears the context."""
        self._check_inputs(inputs)
        sums = np.zeros((len(inputs), self.n_embd), dtype=np.float64)
        for group in self._groups(inputs):
            # Held only within a group: between groups the context is clean and may be shared.
            with self._lock:
                if not self.ctx:
                    raise BackendError("the embeddings context is closed")
                try:
                    llama_cpp.llama_memory_clear(self._mem, True)
                    for _ in self._run_group(inputs, group, sums):
                        yield False
                finally:
                    llama_cpp.llama_memory_clear(self._mem, True)
            yield True
        counts = np.array([len(t) for t in inputs], dtype=np.float64)[:, None]
        means = sums / counts
        norms = np.linalg.norm(means, axis=1, keepdims=True)
        return (means / np.maximum(norms, 1e-12)).tolist()

    def _check_inputs(self, inputs: Sequence[Sequence[int]]) -> None:
        for i, tokens in enumerate(inputs):
            if len(tokens) == 0:
                raise InvalidRequestError(f"input {i} is empty", param="input")
            if len(tokens) > self.n_ctx:
                raise ContextLengthExceededError(
                    f"input {i} has {len(tokens)} tokens; the embeddings context holds {self.n_ctx}",
                    param="input",
                )
            if min(tokens) < 0 or max(tokens) >= self.n_vocab:
                raise InvalidRequestError(f"input {i} has a token id outside the vocabulary", param="input")

    def _groups(self, inputs: Sequence[Sequence[int]]) -> list[list[int]]:
        """Input indices that fit the KV cells and sequence ids of the context together."""
        groups: list[list[int]] = []
        current: list[int] = []
        cells = 0
        for i, tokens in enumerate(inputs):
            if current and (cells + len(tokens) > self.n_ctx or len(current) == self.n_seq_max):
                groups.append(current)
                current, cells = [], 0
            current.append(i)
            cells += len(tokens)
        if current:
            groups.append(current)
        return groups

    def _run_group(self, inputs: Sequence[Sequence[int]], group: list[int], sums: np.ndarray) -> Iterator[None]:
        """Stream the group's tokens through n_batch-sized decodes, summing each input's token rows;
        yields after each decode."""
        # (input index, seq id, next position) of the inputs not fully decoded yet, in order.
        pending = [(idx, seq, 0) for seq, idx in enumerate(group)]
        while pending:
            n = 0
            owners: list[tuple[int, int, int]] = []  # (input index, start row, end row)
            still: list[tuple[int, int, int]] = []
            for idx, seq, pos in pending:
                tokens = inputs[idx]
                take = min(len(tokens) - pos, self.n_batch - n)
                if take > 0:
                    start = n
                    n = self._batch.fill_sequence(tokens[pos:pos + take], seq, pos, offset=n, all_logits=True)
                    owners.append((idx, start, n))
                if pos + take < len(tokens):
                    still.append((idx, seq, pos + max(take, 0)))
            rc = llama_cpp.llama_decode(self.ctx, self._batch.struct)
            if rc != 0:
                raise BackendError(f"embedding decode failed (code {rc})")
            ptr = llama_cpp.llama_get_embeddings(self.ctx)
            if not ptr:
                raise BackendError("the embeddings context produced no embeddings")
            rows = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd))
            for idx, start, end in owners:
                sums[idx] += rows[start:end].sum(axis=0, dtype=np.float64)
            pending = still
            yield
