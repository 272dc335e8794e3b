"""The request-level engine contract: what ModelManager and the server ask of a loaded model.

`ModelEngine` is written in the product's own vocabulary (requests.py): a request goes in, an
async stream of GenerationEvents comes out. engine.Engine implements it with a step-level Backend
under our Scheduler; an engine that batches by itself (onnxruntime-genai's, a remote upstream)
implements the same members without either, and the server cannot tell them apart
(tests/model/test_engine_protocol.py serves a minimal second implementation through the real app).

Everything above this seam (models.py, server/) is typed against these names only: no backend,
scheduler or llama.cpp member is reachable from a handler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from .requests import GenerationEvent, GenerationRequest, Lane


@dataclass(frozen=True)
class RerankFormat:
    """How a reranker (llama.cpp's rank pooling: a classification head) wants a query and a
    document laid out, as llama-server's format_prompt_rerank does: the GGUF's rerank template with
    `{query}` and `{document}` filled in (special tokens parsed, none added), or else the token ids
    `prefix` + query + `middle` + document + `suffix` (BOS, EOS and SEP where the vocabulary adds
    them)."""

    template: str | None = None
    prefix: tuple[int, ...] = ()
    middle: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


@dataclass
class ModelInfo:
    """What a loaded model is: sizes, tokenizer facts and its chat template."""

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
    # The model's fill-in-the-middle tokens by role ("pre", "suf", "mid", and where it has them
    # "pad", "rep", "sep"), as llama.cpp names them; empty for a model that has none.
    fim_tokens: dict[str, int] = field(default_factory=dict)
    # Where it runs, as the backend loaded it (not as planned): layers on the GPU (llama.cpp counts
    # the output layer as one) out of those it could offload, and the device memory its buffers
    # took. All 0 on the CPU and for engines that cannot say.
    gpu_layers: int = 0
    offloadable_layers: int = 0
    gpu_memory_bytes: int = 0
    # Layers whose MoE experts a buffer-type override kept in RAM (cpu_moe), as llama.cpp logged them.
    moe_layers_in_ram: int = 0
    # Device memory per card where the load spread over several ("CUDA0": bytes), as logged.
    gpu_memory_by_device: dict[str, int] = field(default_factory=dict)
    # What the model's projector (mmproj) takes, as llama.cpp's mtmd library says once it loaded it:
    # both False for a model without one. /api/show's `vision` capability reads this.
    vision: bool = False
    audio: bool = False
    # Set for a reranker only (/v1/rerank refuses any other model with a 400 naming it).
    rerank: RerankFormat | None = None
    # The LoRA adapters loaded with it (add --lora, model_loras), by id: their files' paths.
    loras: list[str] = field(default_factory=list)


@dataclass
class EngineStats:
    """A snapshot for /api/ps and /metrics. Fields an engine cannot know stay 0 (an engine that
    batches by itself may report no KV cells or prefix cache)."""

    running: int
    waiting: dict[str, int]  # per lane
    kv_used: int
    kv_total: int
    tokens_per_s: float  # generated tokens per second of recent busy time
    prompt_tokens_per_s: float
    prefix_cache_hits: int  # prompt tokens served from the cache
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hit_rate: float
    steps: int
    busy: bool
    preemptions: int = 0
    interrupted_steps: int = 0  # batch-lane steps stopped for an arriving request (redone after it)
    parked: int = 0  # finished requests kept as prefix cache
    max_sequences: int = 0  # the running batch's capacity (occupancy = running / max_sequences)
    kv_moves: int = 0  # sequences moved to keep the running ids consecutive (batching/kvpool.py)
    cancelled: int = 0  # requests that ended "cancelled" (client gone, stopped reading, shutdown)
    # Speculative decoding (batching/speculation.py), per lane: draft tokens verified, accepted,
    # and the verifications (each emits its accepted drafts plus one token).
    speculative: str = "off"  # the mode this engine runs: auto, ngram or off
    draft_tokens: dict[str, int] = field(default_factory=dict)
    draft_accepted: dict[str, int] = field(default_factory=dict)
    draft_verifications: int = 0
    # llama.cpp threads the steps run with now: fewer than loaded while other processes hold cores
    # (engine/threads.py); 0 where the engine does not say.
    compute_threads: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class EventStream(Protocol):
    """One request's events, in order; the last one carries `finish_reason` (and `usage`)."""

    @property
    def request_id(self) -> str: ...

    def cancel(self) -> None:
        """Safe from any thread or coroutine, and idempotent: the stream then ends with
        finish_reason "cancelled" (unless it already finished) and the engine frees its work."""

    def __aiter__(self) -> AsyncIterator[GenerationEvent]: ...

    async def __anext__(self) -> GenerationEvent: ...


@runtime_checkable
class ModelEngine(Protocol):
    """One loaded model serving many concurrent requests. All members are called from the event
    loop; `tokenize`/`detokenize` may also run in worker threads (long texts), and `shutdown` in one
    (ModelManager unloads off the loop)."""

    name: str  # the model reference it was loaded as ("name:tag")

    @property
    def info(self) -> ModelInfo: ...

    @property
    def n_ctx_per_seq(self) -> int:
        """Tokens one request may hold, prompt and completion together."""

    async def generate(self, request: GenerationRequest) -> EventStream:
        """Queue a request and return its stream; refusals are raised here, before any event:
        InvalidRequestError / ContextLengthExceededError (400), QueueFullError (429),
        OverloadedError (503). Awaitable so that costly preparation (compiling a schema) can run
        off the loop."""

    async def embed(self, inputs: list[list[int]], lane: Lane = "default") -> list[list[float]]:
        """One pooled, normalised vector per token list. Cancelling the caller stops the work.
        `lane`: the request's priority lane; other than "batch" it may interrupt a step of batch
        work, as a generation request does."""

    async def rank(self, inputs: list[list[int]], lane: Lane = "default") -> list[float]:
        """A reranker's relevance score of each token list (a query and a document laid out by
        `info.rerank`), computed as `embed` is; a model that is not a reranker raises
        InvalidRequestError."""

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens` (special tokens render empty; invalid UTF-8 is replaced)."""

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        """Each token's bytes as llama-server's /tokenize and /detokenize show them: special tokens
        as their text (`<|im_start|>`), a piece that splits a UTF-8 character as its raw bytes.
        Ids must be in the vocabulary (the caller checks them)."""

    def stats(self) -> EngineStats: ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything in flight (each stream ends "cancelled") and free the model. Blocking."""


@runtime_checkable
class TextEngine(ModelEngine, Protocol):
    """A ModelEngine that applies its own chat template and tokenizer (a remote upstream): the
    server hands it the client's text (GenerationRequest.text) instead of tokens, and embeds
    texts through `embed_text`. Its `tokenize` raises InvalidRequestError, so a path that needs
    our tokens (Ollama's dialect) refuses such a model with a 400 instead of guessing."""

    async def embed_text(self, inputs: list[str | list[int]],
                         dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """(one vector per input, prompt tokens counted by the engine); `dimensions` as OpenAI's."""
