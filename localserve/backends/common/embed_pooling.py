"""Embeddings as llama.cpp computes them for decoder models, for any backend: per-token rows summed
across decodes, mean-pooled and L2-normalised, many inputs per decode.

Pooling is done here in numpy over per-token embeddings (llama.cpp's pooling NONE), not by
llama.cpp's MEAN pooling: llama.cpp pools within one decode call, so an input longer than one batch
would be pooled wrongly, and MEAN with n_seq_max > 1 aborted context creation for some models in
our research (GGML_ASSERT in build_pooling). Summing per-token rows across decodes has neither
problem, and the ONNX backend pools its graph's rows with the same code, so both backends answer
alike for the same model.

A subclass supplies the compute: `_begin_group` / `_end_group` around each group of inputs (a
clean KV state for it), and `_decode`, which runs one packed batch of input pieces and returns one
row per token.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Generator, Iterator, Sequence

import numpy as np

from ...errors import BackendError, ContextLengthExceededError, InvalidRequestError

# One decode's input: (tokens, sequence id, position of the first token).
Piece = tuple[Sequence[int], int, int]


def group_inputs(inputs: Sequence[Sequence[int]], n_cells: int, n_seqs: int) -> list[list[int]]:
    """Input indices, in order, in groups that fit `n_cells` KV cells and `n_seqs` sequence ids
    together (an input longer than n_cells alone is a group of its own: callers refuse it first)."""
    groups: list[list[int]] = []
    current: list[int] = []
    cells = 0
    for i, tokens in enumerate(inputs):
        if current and (cells + len(tokens) > n_cells or len(current) == n_seqs):
            groups.append(current)
            current, cells = [], 0
        current.append(i)
        cells += len(tokens)
    if current:
        groups.append(current)
    return groups


class PooledEmbedder(ABC):
    def __init__(self, *, n_ctx: int, n_batch: int, n_seq_max: int, n_embd: int, n_vocab: int) -> None:
        self.n_ctx = n_ctx  # KV cells one group of inputs may use together
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.n_embd = n_embd
        self.n_vocab = n_vocab
        self._lock = threading.Lock()  # one group at a time per embedder

    @abstractmethod
    def _is_open(self) -> bool: ...

    @abstractmethod
    def _begin_group(self, cells: int) -> None:
        """Before a group: an empty KV state with room for `cells` tokens."""

    @abstractmethod
    def _end_group(self) -> None:
        """After a group, also when it failed or was abandoned: nothing of it stays."""

    @abstractmethod
    def _decode(self, pieces: list[Piece], n_tokens: int) -> np.ndarray:
        """Run the pieces as one batch (in order); [n_tokens, n_embd] per-token rows, read before
        the next call."""

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
        embedder holds nothing of this call (another call may run next), False within a group (its
        KV cells are still needed: nothing else may use this embedder before the next `next()`).
        Closing the generator early clears the state."""
        self._check_inputs(inputs)
        sums = np.zeros((len(inputs), self.n_embd), dtype=np.float64)
        for group in self._groups(inputs):
            # Held only within a group: between groups the state is clean and may be shared.
            with self._lock:
                if not self._is_open():
                    raise BackendError("the embeddings context is closed")
                self._begin_group(sum(len(inputs[i]) for i in group))
                try:
                    for _ in self._run_group(inputs, group, sums):
                        yield False
                finally:
                    self._end_group()
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
        return group_inputs(inputs, self.n_ctx, self.n_seq_max)

    def _run_group(self, inputs: Sequence[Sequence[int]], group: list[int], sums: np.ndarray) -> Iterator[None]:
        """Stream the group's tokens through n_batch-sized decodes, summing each input's token rows;
        yields after each decode."""
        for pieces, owners, n in decode_plan(inputs, group, self.n_batch):
            rows = self._decode(pieces, n)
            for idx, start, end in owners:
                sums[idx] += rows[start:end].sum(axis=0, dtype=np.float64)
            yield


def decode_plan(inputs: Sequence[Sequence[int]], group: list[int],
                n_batch: int) -> Iterator[tuple[list[Piece], list[tuple[int, int, int]], int]]:
    """A group's tokens as decodes of at most n_batch tokens, inputs in order, each on sequence id
    = its place in the group: per decode (pieces, owners as (input index, first row, end row),
    token count)."""
    # (input index, seq id, next position) of the inputs not fully decoded yet, in order.
    pending = [(idx, seq, 0) for seq, idx in enumerate(group)]
    while pending:
        n = 0
        pieces: list[Piece] = []
        owners: list[tuple[int, int, int]] = []
        still: list[tuple[int, int, int]] = []
        for idx, seq, pos in pending:
            tokens = inputs[idx]
            take = min(len(tokens) - pos, n_batch - n)
            if take > 0:
                pieces.append((tokens[pos:pos + take], seq, pos))
                owners.append((idx, n, n + take))
                n += take
            if pos + take < len(tokens):
                still.append((idx, seq, pos + max(take, 0)))
        yield pieces, owners, n
        pending = still
