"""A reusable `llama_batch` whose arrays are numpy-owned, filled without per-field ctypes writes.

Filling a llama_batch field by field through ctypes costs ~1 ms per 2,048 tokens; numpy views over
the same memory make a fill a handful of vectorised copies. Used by the backend's decode, by the
embeddings context, and by the benchmark's bare baseline loop, so all three pay the same cost.

We build the struct ourselves instead of `llama_batch_init`: its arrays are malloc'ed per token
(one seq_id array each) and must be released with `llama_batch_free`; here every token's seq_id
pointer points into one contiguous int32 array, so the seq ids too are one numpy copy.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import llama_cpp
import numpy as np

from ..base import BatchToken

_c_int32_p = ctypes.POINTER(ctypes.c_int32)


class PackedBatch:
    """A llama_batch of up to `capacity` tokens, one sequence id per token; with `n_embd`, of
    embedding rows instead (an image's positions: llama.cpp takes one or the other per batch)."""

    def __init__(self, capacity: int, n_embd: int = 0) -> None:
        if capacity <= 0:
            raise ValueError("batch capacity must be positive")
        self.capacity = capacity
        self.n_tokens = 0
        self.token = np.zeros(capacity, dtype=np.int32)
        # The rows' ids as the scheduler gave them: negative ones are image positions (media.py),
        # which `token` holds as 0 and a call of their own decodes from embeddings.
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        # seq_id is `llama_seq_id **`: pointer i -> &self.seq[i].
        self._seq_ptrs = (self.seq.ctypes.data + self.seq.itemsize * np.arange(capacity, dtype=np.uintp)).astype(
            np.uintp
        )
        b = llama_cpp.llama_batch()
        b.n_tokens = 0
        b.token = self.token.ctypes.data_as(_c_int32_p)
        b.embd = ctypes.POINTER(ctypes.c_float)()  # NULL: token mode
        if n_embd:
            self.embd = np.zeros((capacity, n_embd), dtype=np.float32)
            b.token = _c_int32_p()  # NULL: embeddings mode
            b.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = self.pos.ctypes.data_as(_c_int32_p)
        b.n_seq_id = self._n_seq_id.ctypes.data_as(_c_int32_p)
        b.seq_id = ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(_c_int32_p))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct = b

    def _set_count(self, n: int) -> int:
        if n <= 0:
            raise ValueError("empty batch")
        if n > self.capacity:
            # llama.cpp GGML_ASSERTs (aborts the whole process) on n_tokens > n_batch.
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.capacity}; split the step")
        self.n_tokens = n
        self.struct.n_tokens = n
        return n

    def fill(self, tokens, seq_ids, positions, logits) -> int:
        """Fill from four equal-length array-likes (numpy arrays or lists); returns the token count."""
        n = self._set_count(len(tokens))
        if not (len(seq_ids) == len(positions) == len(logits) == n):
            raise ValueError("tokens, seq_ids, positions and logits must have the same length")
        self.token[:n] = tokens
        self.ids[:n] = tokens
        self.seq[:n] = seq_ids
        self.pos[:n] = positions
        self.logits[:n] = logits
        return n

    def fill_tokens(self, batch: Sequence[BatchToken]) -> int:
        """Fill from the contract's BatchToken list (one Python pass, then one numpy copy)."""
        n = self._set_count(len(batch))
        rows = np.array([(t.token, t.seq_id, t.pos, t.logits) for t in batch], dtype=np.int64)
        self.ids[:n] = rows[:, 0]
        self.token[:n] = np.maximum(rows[:, 0], 0)
        self.seq[:n] = rows[:, 1]
        self.pos[:n] = rows[:, 2]
        self.logits[:n] = rows[:, 3]
        return n

    def fill_embeddings(self, embd: np.ndarray, seq_ids, positions, logits) -> int:
        """Fill an embeddings-mode batch: one row of `embd` per position."""
        n = self._set_count(len(embd))
        self.embd[:n] = embd
        self.seq[:n] = seq_ids
        self.pos[:n] = positions
        self.logits[:n] = logits
        return n

    def media_rows(self) -> np.ndarray:
        """Which rows of the last fill_tokens are image positions."""
        return self.ids[: self.n_tokens] < 0

    def fill_sequence(self, tokens: Sequence[int], seq_id: int, start_pos: int, offset: int = 0,
                      all_logits: bool = False) -> int:
        """Append one sequence's tokens at `offset`; returns the new token count. Used by embeddings."""
        m = len(tokens)
        end = self._set_count(offset + m)
        self.token[offset:end] = tokens
        self.seq[offset:end] = seq_id
        self.pos[offset:end] = np.arange(start_pos, start_pos + m, dtype=np.int32)
        self.logits[offset:end] = 1 if all_logits else 0
        return end

    def check_ids(self, n_vocab: int, n_seq_max: int) -> None:
        """Reject ids llama.cpp would misuse: out-of-range seq ids hit GGML_ASSERTs in the KV cache."""
        n = self.n_tokens
        seq = self.seq[:n]
        if int(seq.min()) < 0 or int(seq.max()) >= n_seq_max:
            raise ValueError(f"sequence id out of range 0..{n_seq_max - 1}")
        tok = self.token[:n]
        if int(tok.min()) < 0 or int(tok.max()) >= n_vocab:
            raise ValueError(f"token id out of range 0..{n_vocab - 1}")
        if int(self.pos[:n].min()) < 0:
            raise ValueError("negative position")


def stream_groups(seq: np.ndarray) -> list[np.ndarray] | None:
    """How to submit one step's batch to a context with one KV stream per sequence, so that every
    token is computed exactly as it would be if its request ran alone; None: as it is, one call.

    Why: llama.cpp splits such a batch into micro-batches that hold an equal number of tokens of
    each sequence, and only of sequences with consecutive ids in batch order. A prompt chunk next
    to decoding sequences therefore gets one of its tokens computed in a micro-batch where its
    sequence has a single row. The CPU matmul kernels differ for one row (a GEMV) and for several
    (llamafile's tiled GEMM); they round differently, and a greedy answer can change with what else
    was running (measured on SmolLM2: a prompt's last logits moved by 0.43). So every sequence with
    several tokens gets a call of its own, and the one-token rows (decodes) go together last, in
    ascending id order, which keeps consecutive ids in one micro-batch. Returns index arrays into
    the batch, in submission order."""
    n = len(seq)
    counts = np.bincount(seq)
    multi = counts[seq] > 1
    if not multi.any():
        if n == 1 or bool(np.all(seq[1:] > seq[:-1])):
            return None
        return [np.argsort(seq, kind="stable")]
    multi_ids = seq[multi]
    first = np.unique(multi_ids, return_index=True)[1]
    groups = [np.flatnonzero(seq == s) for s in multi_ids[np.sort(first)]]
    if len(groups) == 1 and len(groups[0]) == n:
        return None
    singles = np.flatnonzero(~multi)
    if len(singles):
        groups.append(singles[np.argsort(seq[singles], kind="stable")])
    return groups


def media_calls(groups: list[np.ndarray] | None, n: int, media: np.ndarray) -> list[np.ndarray]:
    """`groups` (stream_groups' calls, None: one call) cut where rows turn from tokens to image
    positions or back: llama_decode takes tokens or embeddings, never both. Within a sequence its
    rows stay in position order (text before an image is in the cache before the image is read)."""
    calls = []
    for rows in groups if groups is not None else [np.arange(n)]:
        kind = media[rows]
        cuts = np.flatnonzero(kind[1:] != kind[:-1]) + 1
        calls.extend(np.split(rows, cuts))
    return calls
