"""The Backend contract: one model, one KV cache shared by many sequences, packed batches.

A batch is a flat list of tokens of different sequences side by side (no padding, any lengths),
each with its sequence id, its position and whether its logits are wanted. After `decode`, the
rows that wanted logits can be sampled by their index in that batch -- only until the next decode,
because backends (llama.cpp) keep the logits of the last call only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..batching.params import SamplingParams, TokenLogprob
from ..errors import BackendError


class KVFullError(BackendError):
    """decode found no room in the KV cache; nothing of the batch was kept. The scheduler must free
    cells (preempt) or shrink the batch and retry."""


@dataclass(frozen=True, slots=True)
class BatchToken:
    token: int
    seq_id: int
    pos: int
    logits: bool = False


@dataclass
class SampledToken:
    token: int
    logprob: TokenLogprob | None = None  # set when the sampler was asked for logprobs


@dataclass
class ModelInfo:
    name: str
    architecture: str
    n_ctx_train: int
    n_vocab: int
    n_embd: int
    n_params: int
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    metadata: dict[str, Any] = field(default_factory=dict)


class Sampler(ABC):
    """Per-sequence sampling state (penalty history, grammar state, RNG)."""

    @abstractmethod
    def sample(self, batch_index: int) -> SampledToken:
        """Sample from the logits of row `batch_index` of the last decode, and accept the token.

        ValueError if that row asked for no logits; InvalidRequestError if the request's
        constraints (grammar plus logit_bias) leave no token to choose."""

    def close(self) -> None:
        """Release native resources; idempotent."""


class Backend(ABC):
    # KV cells of all sequences together (one shared pool, or per-sequence streams: `kv_unified`).
    # llama.cpp reports no count of used cells, so the scheduler keeps the books: one cell per token
    # decoded for a sequence, cells shared through kv_copy count once, a cell is free when no
    # sequence holds it (batching/kvpool.py).
    n_ctx: int
    n_batch: int  # hard cap of tokens per decode call: never exceed it (llama.cpp aborts the process)
    # llama.cpp computes a decode in micro-batches of at most this many tokens (scheduler.py keeps
    # prompt chunks from leaving one token alone in a micro-batch).
    n_ubatch: int
    n_seq_max: int  # sequence ids are 0 .. n_seq_max-1
    info: ModelInfo

    # --- compute -------------------------------------------------------------------------
    @abstractmethod
    def decode(self, batch: Sequence[BatchToken]) -> None:
        """Run one packed batch.

        Raises ValueError before running anything for a batch that breaks the rules (empty, more
        than n_batch tokens, sequence or token ids out of range); KVFullError when there is no room
        (nothing kept); BackendError when the compute failed (the batch's positions are rolled back,
        so every sequence is as it was before the call)."""

    @abstractmethod
    def new_sampler(self, params: SamplingParams, prompt_tokens: Sequence[int]) -> Sampler:
        """A sampler for one sequence; prompt tokens prime stateful parts (penalties)."""

    @abstractmethod
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One pooled, L2-normalised vector per input, several inputs per decode."""

    # --- KV cache, per sequence ----------------------------------------------------------
    @abstractmethod
    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Drop positions [p0, p1) of a sequence (p1=-1: to the end)."""

    @abstractmethod
    def kv_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Make positions [p0, p1) of `src` part of `dst` too (cells shared, not duplicated, where
        the backend can; a backend with `kv_unified = False` copies them into dst's own stream).
        `dst` should hold nothing in that range (kv_remove it first)."""

    def kv_move(self, src: int, dst: int) -> None:
        """Move everything `src` holds to the empty id `dst`; `src` is left empty. The scheduler
        moves sequences to keep the running ones on consecutive ids (llama.cpp batches only those
        together, see batching/kvpool.py)."""
        self.kv_copy(src, dst, 0, -1)
        self.kv_remove(src, 0, -1)

    @abstractmethod
    def kv_pos_max(self, seq_id: int) -> int:
        """Highest position held for the sequence, -1 when empty."""

    # --- tokenizer -----------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    @abstractmethod
    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character); special tokens render
        empty unless `special` is set."""

    @abstractmethod
    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ...)."""

    def close(self) -> None:
        """Free the model and context."""
