"""The Backend contract: one model, one KV cache shared by many sequences, packed batches.

A batch is a flat list of tokens of different sequences side by side (no padding, any lengths),
each with its sequence id, its position and whether its logits are wanted. After `decode`, the
rows that wanted logits can be sampled by their index in that batch -- only until the next decode,
because backends (llama.cpp) keep the logits of the last call only.

Everything the scheduler must know about a backend's limits and rules is declared in its
`Capabilities` (docs/architecture.md, "The Backend contract"): the scheduler reads that object and
no other member, so a second backend states its own rules instead of inheriting llama.cpp's.

Before a load, a backend class also sizes its own cache: `Backend.plan_kv` turns the engine's
backend-neutral demand (`KVRequest`, batching/limits.py) into how its context is made (`KVSizing`),
so llama.cpp's layout, padding and id rules live with llama.cpp (backends/llamacpp/sizing.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Generator, Literal, Sequence

from ..config.kv_cache import kv_element_bytes
from ..protocol.engine import ModelInfo
from ..protocol.requests import LoraSet, SamplingParams, TokenLogprob
from ..errors import BackendError, InvalidRequestError
from ..protocol.media import MediaInput


class KVFullError(BackendError):
    """decode found no room in the KV cache; nothing of the batch was kept. The scheduler must free
    cells (preempt) or shrink the batch and retry."""


class DecodeInterrupted(BackendError):
    """An interruptible decode stopped because `Backend.interrupt` was called; nothing of the batch
    was kept, and the scheduler plans the step again (with whatever arrived meanwhile)."""


def seq_ids_for(max_sequences: int, prefix_cache: bool) -> int:
    """Sequence ids an engine of `max_sequences` needs: the running ones plus, with the prefix
    cache, as many parked entries (a finished request's KV stays resident under its own id)."""
    return max_sequences * (2 if prefix_cache else 1)


@dataclass(frozen=True, slots=True)
class KVRequest:
    """What the engine wants of a backend's KV cache, before the backend's own rules."""

    n_ctx_seq: int  # tokens one request may hold (prompt + answer)
    max_sequences: int  # requests running at once (within the step budget already)
    prefix_cache: bool  # parked prefix-cache entries need ids and cells of their own
    kv_budget_bytes: int  # memory the cache may take
    kv_bytes_per_token: int  # K+V of one token in f16
    layout: str  # the kv_layout setting: "auto", "streams" or "unified"
    kv_type: str  # "auto" or a checked K/V type (config/kv_cache.py): the model's, else kv_cache_type
    flash_attention: bool  # the flash_attention setting

    @property
    def seq_ids(self) -> int:
        return seq_ids_for(self.max_sequences, self.prefix_cache)


@dataclass(frozen=True, slots=True)
class KVSizing:
    """How a backend will make its context for a KVRequest (EngineLimits holds the same fields)."""

    n_ctx: int  # KV cells of all sequences together
    n_ctx_seq: int  # tokens one request may hold
    max_sequences: int
    kv_unified: bool  # one pool shared by every sequence (else a stream per sequence id)
    kv_type: str  # "K/V" or one name for both ("f16", "q8_0", "q8_0/f16": config/kv_cache.py)
    flash_attention: bool


PrefixSharing = Literal["share", "copy"]
PREFIX_SHARING: tuple[PrefixSharing, ...] = ("share", "copy")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the scheduler must know about a loaded backend; fixed for its lifetime."""

    max_batch_tokens: int  # tokens per decode call, a hard cap (llama.cpp aborts the process past it)
    kv_cells: int  # KV cells of all sequences together
    kv_cells_per_seq: int  # cells one sequence may hold: the whole pool, or its own stream
    max_seqs: int  # sequence ids are 0 .. max_seqs-1
    # "share": kv_copy makes a prefix's cells part of the destination too (counted once, freed when
    # no sequence holds them); "copy": the destination gets copies in its own cells.
    prefix_sharing: PrefixSharing
    # True: sequences are computed in one pass only when their ids are consecutive (llama.cpp's
    # splitter with per-sequence streams), so the scheduler keeps the running ones on a block of
    # consecutive ids and moves stragglers in with kv_move (batching/kvpool.py); the same splitter
    # makes batch rows beside a prompt chunk cost it micro-batches, so they sit that step out.
    consecutive_ids: bool
    # The backend computes a decode in micro-batches of this many tokens (max_batch_tokens: one).
    micro_batch: int
    # Fewest prompt tokens of one sequence that may be computed together: a prompt chunk, the rest
    # it leaves for later, and a chunk's share of a micro-batch are never smaller (except a whole
    # prompt shorter than this). llama.cpp: 2, since a lone row takes other matmul kernels (GEMV,
    # not GEMM) that round differently, and the answer would depend on how the prompt was cut.
    min_chunk: int = 1
    # Prompt tokens a prefix-cache hit never covers: at least 1 (the last token's logits are needed);
    # llama.cpp: 2, so the rest is never one lone row either (prefix_cache.PrefixCache.lookup).
    min_recompute: int = 1
    constraints: frozenset[str] = frozenset()  # constrained-decoding kinds new_sampler accepts
    embeddings: bool = False  # whether embed() works
    # decode(batch, interruptible=True) stops within a fraction of a step once interrupt() is called
    # from another thread: a step of batch-lane work alone may then be long, since an interactive
    # request arriving during it need not wait for its end.
    interruptible: bool = False
    # decode() gives logits for several consecutive rows of one sequence, and kv_remove drops a
    # suffix of its positions: speculative decoding can verify drafts (batching/speculation.py).
    speculation: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "kv_cells", "kv_cells_per_seq", "max_seqs", "micro_batch",
                     "min_chunk", "min_recompute"):
            if getattr(self, name) < 1:
                raise ValueError(f"Capabilities.{name} must be at least 1 (got {getattr(self, name)})")
        if self.kv_cells_per_seq > self.kv_cells:
            raise ValueError("Capabilities.kv_cells_per_seq exceeds kv_cells")
        if not self.min_chunk <= self.micro_batch <= self.max_batch_tokens:
            raise ValueError("Capabilities need min_chunk <= micro_batch <= max_batch_tokens")
        if self.prefix_sharing not in PREFIX_SHARING:
            raise ValueError(f"Capabilities.prefix_sharing must be one of {PREFIX_SHARING}")

    def chunk(self, pending: int, budget: int) -> int:
        """How many of a sequence's `pending` prompt tokens to compute in a step with `budget`
        tokens left: as many as fit, cut so that neither the rest nor the chunk's last
        micro-batch holds fewer than `min_chunk` tokens; 0 when no such cut fits now."""
        floor = min(self.min_chunk, pending)  # a shorter prompt goes whole
        for n in range(min(pending, budget), floor - 1, -1):
            rest, tail = pending - n, n % self.micro_batch
            if (rest == 0 or rest >= floor) and (tail == 0 or tail >= floor):
                return n
        return 0


@dataclass(frozen=True, slots=True)
class BatchToken:
    # A negative token is a position of an image (protocol/media.py): a backend with a projector
    # decodes its embedding row, one without refuses it.
    token: int
    seq_id: int
    pos: int
    logits: bool = False


@dataclass
class SampledToken:
    token: int
    logprob: TokenLogprob | None = None  # set when the sampler was asked for logprobs


class Sampler(ABC):
    """Per-sequence sampling state (penalty history, grammar state, RNG)."""

    @abstractmethod
    def sample(self, batch_index: int) -> SampledToken:
        """Sample from the logits of row `batch_index` of the last decode, and accept the token.

        ValueError if that row asked for no logits; InvalidRequestError if the request's
        constraints (grammar plus logit_bias) leave no token to choose."""

    def close(self) -> None:
        """Release native resources; idempotent."""


def declared_capabilities(backend: "Backend") -> Capabilities:
    """The backend's Capabilities, checked: what the scheduler is built from (engine/local.py)."""
    caps = backend.capabilities
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{type(backend).__name__}.capabilities must be a Capabilities, not {type(caps).__name__}")
    return caps


class Backend(ABC):
    # llama.cpp reports no count of used cells, so the scheduler keeps the books from the declared
    # capabilities: one cell per token decoded for a sequence, cells shared through kv_copy count
    # once, a cell is free when no sequence holds it (batching/kvpool.py).
    info: ModelInfo
    # Compute threads it was loaded with, the most set_threads may ask for; 0: the count is fixed
    # for its life (an ONNX session's thread pool), and the engine leaves it alone.
    n_threads: int = 0
    adjustable_threads: bool = False

    def set_threads(self, n: int) -> None:
        """Compute the next decodes with `n` threads, 1..n_threads (engine/threads.py), where
        adjustable_threads; results must not depend on it, only speed."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """The limits and rules the scheduler plans by. Abstract, so a backend that declares none
        cannot be instantiated rather than run under some other backend's defaults."""

    @classmethod
    def plan_kv(cls, want: KVRequest) -> KVSizing:
        """Size this backend's cache for `want`, before a load. The rule of a backend with one
        shared pool and no layout of its own: room for every running request at full length
        within the budget, never less than one, cells as the budget gives them (no padding)."""
        kv_type = "f16" if want.kv_type == "auto" else want.kv_type
        cell_bytes = max(1, math.ceil(want.kv_bytes_per_token * kv_element_bytes(kv_type) / 2))
        n_ctx = max(want.n_ctx_seq, min(want.max_sequences * want.n_ctx_seq, want.kv_budget_bytes // cell_bytes))
        return KVSizing(n_ctx=n_ctx, n_ctx_seq=want.n_ctx_seq, max_sequences=want.max_sequences, kv_unified=True,
                        kv_type=kv_type, flash_attention=want.flash_attention)

    # --- compute -------------------------------------------------------------------------
    @abstractmethod
    def decode(self, batch: Sequence[BatchToken], interruptible: bool = False) -> None:
        """Run one packed batch.

        Raises ValueError before running anything for a batch that breaks the rules (empty, more
        than capabilities.max_batch_tokens tokens, sequence or token ids out of range); KVFullError when there is no room
        (nothing kept); BackendError when the compute failed (the batch's positions are rolled back,
        so every sequence is as it was before the call); DecodeInterrupted when `interruptible`
        and interrupt() was called since the last clear_interrupt() (rolled back the same way).
        A backend whose capabilities are not `interruptible` ignores the flag."""

    def interrupt(self) -> None:
        """Stop the interruptible decode running now, or the next one if none is (any thread)."""

    def clear_interrupt(self) -> None:
        """Forget an interrupt() that no decode has acted on (the engine thread, before it takes
        new requests in: what arrived until then is in the next plan anyway)."""

    @abstractmethod
    def new_sampler(self, params: SamplingParams, prompt_tokens: Sequence[int]) -> Sampler:
        """A sampler for one sequence; prompt tokens prime stateful parts (penalties)."""

    @abstractmethod
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One pooled, L2-normalised vector per input, several inputs per decode."""

    def embed_steps(self, inputs: Sequence[Sequence[int]]) -> Generator[bool, None, list[list[float]]]:
        """`embed` in bounded pieces, for the engine thread to interleave with generation steps:
        each `next()` does at most one decode and yields True where another embed_steps run may
        go next (nothing of this one is left in the backend's state), False mid-way; the vectors
        are the generator's return value. This default does everything in one piece."""
        vectors = self.embed(inputs)
        yield True
        return vectors

    def rank_steps(self, inputs: Sequence[Sequence[int]],
                   room: Callable[[int], int] | None = None) -> Generator[bool, None, list[float]]:
        """A reranker's score of each token list, in `embed_steps`' pieces, each decode at most
        `room(most)` tokens where given (the engine's share beside running chats). Only a backend
        that reads a GGUF's rank pooling (llama.cpp's) has one."""
        raise InvalidRequestError("this model's backend does not rerank", param="model")
        yield True  # a generator, like every embed_steps

    # --- KV cache, per sequence ----------------------------------------------------------
    @abstractmethod
    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Drop positions [p0, p1) of a sequence (p1=-1: to the end)."""

    @abstractmethod
    def kv_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Make positions [p0, p1) of `src` part of `dst` too: cells shared, not duplicated, or
        copied into dst's own cells, as capabilities.prefix_sharing says.
        `dst` should hold nothing in that range (kv_remove it first)."""

    def kv_move(self, src: int, dst: int) -> None:
        """Move everything `src` holds to the empty id `dst`; `src` is left empty. The scheduler
        moves sequences only for a backend that declares `consecutive_ids` (batching/kvpool.py)."""
        self.kv_copy(src, dst, 0, -1)
        self.kv_remove(src, 0, -1)

    @abstractmethod
    def kv_pos_max(self, seq_id: int) -> int:
        """Highest position held for the sequence, -1 when empty."""

    def release_idle_memory(self, now: float) -> float | None:
        """Give back memory the cache has held unused for a while (llama.cpp: the pages of KV
        streams left empty); the seconds until more is due, None when nothing waits. The engine
        calls it before each step and wakes for it when idle."""
        return None

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

    # --- images (a projector beside the model: llamacpp/media.py) ------------------------------
    def tokenize_media(self, text: str, images: Sequence[MediaInput], add_special: bool = True) -> list[int]:
        """The ids of a prompt whose text holds one MEDIA_MARKER per image: its text tokens, and
        negative ids for the images' positions (the same image, the same ids)."""
        raise InvalidRequestError(f"{self.info.name} takes no images", param="model")

    def hold_media(self, tokens: Sequence[int], images: Sequence[MediaInput]) -> object:
        """Keep what decoding `tokens`' image positions needs until `release_media(held)`."""
        raise InvalidRequestError(f"{self.info.name} takes no images", param="model")

    def release_media(self, held: object) -> None:
        """Give back what hold_media kept."""

    # --- LoRA adapters (llamacpp/lora.py) ------------------------------------------------------
    def set_adapters(self, adapters: LoraSet) -> None:
        """Compute the next decodes with these (adapter id, scale) pairs applied, and no others
        (`info.loras` are the ids); the engine calls it before a step whose set differs. A backend
        without adapters has nothing to apply for the empty set."""
        if adapters:
            raise InvalidRequestError(f"{self.info.name} has no LoRA adapters", param="lora")

    def close(self) -> None:
        """Free the model and context."""
