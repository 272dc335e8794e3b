"""What a caller asks of an engine (GenerationRequest, SamplingParams) and what it gets back (events).

The product's neutral vocabulary, below every package that uses it: server/ builds these from HTTP
bodies, engines (engine.py, or one that batches by itself) consume them, backends/ sample by
SamplingParams, batching/ schedules by lane. They carry token ids, never HTTP or backend objects.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from ..errors import ContextLengthExceededError, InvalidRequestError, LocalserveError
from .media import MediaInput

Lane = Literal["interactive", "default", "batch"]
LANES: tuple[Lane, ...] = ("interactive", "default", "batch")  # highest priority first
LANE_RANK: dict[str, int] = {lane: rank for rank, lane in enumerate(LANES)}  # 0 = highest priority

FinishReason = Literal["stop", "length", "cancelled", "error"]

_request_ids = itertools.count(1)

# What every backend can sample with (SamplingParams.validate), for every entry point (HTTP bodies,
# batch lines, direct engine callers): (low, high, low bound inclusive). The HTTP dialects accept
# narrower, documented ranges inside these (OpenAI's penalties -2..2, server/validation.py), and
# call validate too, so nothing a body passes can fail later in a backend after a model load.
SAMPLING_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, math.inf, True),
    "top_p": (0.0, 1.0, False),  # 0 keeps no token at all: llama.cpp's top-p then has nothing to sample
    "min_p": (0.0, 1.0, True),
    "repeat_penalty": (0.0, math.inf, False),  # the penalty divides logits: 0 would divide by zero
    "frequency_penalty": (-math.inf, math.inf, True),
    "presence_penalty": (-math.inf, math.inf, True),
}
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    seed: int | None = None  # None = random; a seed makes the request reproducible even inside a shared batch
    repeat_penalty: float = 1.0  # 1.0 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # GBNF text
    json_schema: dict | None = None  # compiled to GBNF by the backend; {} = any JSON object
    constraint_param: str = "response_format"  # the request field json_schema came from, named in errors
    logprobs: int | None = None  # None = off; N = chosen token's logprob plus N top alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self, n_vocab: int | None = None, *,
                 param: Callable[[str], str] = lambda name: name) -> "SamplingParams":
        """Self, or InvalidRequestError naming the field (as `param` spells it for the caller, e.g.
        Ollama's `options.top_p`). Cheap and model-free, so the server refuses before any model
        load; `n_vocab` (when known) bounds logit_bias ids."""
        def bad(name: str, problem: str) -> InvalidRequestError:
            return InvalidRequestError(f"'{param(name)}' {problem}", param=param(name))

        for name, (lo, hi, lo_inclusive) in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise bad(name, "must be a finite number")
            if not ((lo <= value) if lo_inclusive else (lo < value)) or value > hi:
                low = f"at least {lo:g}" if lo_inclusive else f"greater than {lo:g}"
                raise bad(name, f"must be {low} and at most {hi:g} (got {value:g})")
        if self.top_k < 0:
            raise bad("top_k", f"must not be negative (got {self.top_k})")
        if self.penalty_last_n < -1:  # -1 = the whole context; backends cap larger windows to it
            raise bad("penalty_last_n", f"must be -1 or more (got {self.penalty_last_n})")
        if self.seed is not None and not 0 <= self.seed <= 0xFFFFFFFF:
            raise bad("seed", "must be between 0 and 4294967295")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0 or (n_vocab and token >= n_vocab):
                upto = f" (0..{n_vocab - 1})" if n_vocab else ""
                raise bad("logit_bias", f"token id {token!r} is outside the vocabulary{upto}")
            if math.isnan(bias) or bias == math.inf:
                # +inf turns the softmax into NaN; -inf is the documented way to ban a token.
                raise bad("logit_bias", "biases must be finite numbers or -inf")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        return self


@dataclass
class TextPrompt:
    """The prompt as the client wrote it, for an engine that templates and tokenizes by itself
    (engine_api.TextEngine, e.g. a remote upstream): prompt_tokens then stay empty."""

    kind: Literal["chat", "completion"]
    messages: list[dict[str, Any]] | None = None  # chat
    prompt: str | list[int] | None = None  # completion
    # The client's own generation fields (OpenAI names, only those it sent), so the engine passes
    # exactly them on and its defaults stay the engine's, as when a client calls it directly.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Thinking:
    """A reasoning template's think block as the engine sees it (issue 45): the engine counts the
    tokens inside it (Usage.reasoning_tokens) and, once `budget` of them are spent, closes it itself
    with `end`, the model's own end-of-think tokens (`</think>`), in place of the next sampled token;
    the answer follows. `start` empty: the prompt opened the block (DeepSeek-R1 distills end it
    with `<think>`); else the answer's first tokens must be `start` (Qwen3 opens it itself)."""

    end: list[int]
    start: list[int] = field(default_factory=list)
    budget: int | None = None  # None: as long as the model thinks; 0: closed before it thinks at all


# A request's LoRA adapters (issue 45): (adapter id, scale) pairs, ids ascending, no zero scales. llama.cpp
# applies adapters to a whole context, so only requests with equal sets share a decode
# (batching/adapter_turns.py), and KV cells computed under one set are another set's cache never.
LoraSet = tuple[tuple[int, float], ...]
MAX_LORA_SCALE = 1e4  # far beyond any useful strength; a larger number is a client's mistake


def lora_set(pairs: "list[tuple[int, float]] | LoraSet | None", n_adapters: int, model: str) -> LoraSet:
    """The set a request runs with on a model of `n_adapters` adapters (llama-server's rule): None
    (the request named none) is every adapter at scale 1; a list sets the scales of the ids it names
    and leaves the others off. InvalidRequestError (param `lora`) naming `model` where it has no
    adapters, an id is not one of its adapters, or a scale is not a finite number within bounds."""
    if pairs is None:
        return tuple((i, 1.0) for i in range(n_adapters))
    if pairs and not n_adapters:
        raise InvalidRequestError(f"the model {model} has no LoRA adapters ('lora' names one)", param="lora")
    scales: dict[int, float] = {}
    for adapter, scale in pairs:
        if not isinstance(adapter, int) or isinstance(adapter, bool) or not 0 <= adapter < n_adapters:
            raise InvalidRequestError(f"'lora' names adapter id {adapter!r}, but the model {model} has "
                                      f"adapters 0..{n_adapters - 1}", param="lora")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and abs(scale) <= MAX_LORA_SCALE):
            raise InvalidRequestError(f"'lora' scale of adapter {adapter} must be a finite number of at most "
                                      f"{MAX_LORA_SCALE:g} in size (model {model})", param="lora")
        scales[adapter] = float(scale)
    return tuple(sorted((i, s) for i, s in scales.items() if s != 0.0))


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings: found across token boundaries, never emitted
    lane: Lane = "default"
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")
    text: TextPrompt | None = None  # set for TextEngines only
    speculative: bool = True  # False: never drafted for, whatever the model's setting says
    # The prompt's images and audio clips in order, one per MEDIA_MARKER the prompt text held
    # (protocol/media.py); only a model whose projector takes them (ModelInfo.vision, .audio).
    images: list[MediaInput] = field(default_factory=list)
    thinking: Thinking | None = None  # set where the chat template reasons (api/think_budget.py)
    # The LoRA adapters named, as (id, scale) pairs; None: the model's own (lora_set). The engine
    # replaces it with the checked LoraSet at submit.
    lora: "list[tuple[int, float]] | LoraSet | None" = None


@dataclass
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token, text, logprob) alternatives


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    reasoning_tokens: int = 0  # completion tokens inside the think block (GenerationRequest.thinking)
    queue_s: float = 0.0  # submit -> first scheduled
    ttft_s: float = 0.0  # submit -> first token
    total_s: float = 0.0


@dataclass
class GenerationEvent:
    """One step's output for one request. The last event has `finish_reason` and `usage` set."""

    text: str = ""  # UTF-8-safe delta; stop strings and incomplete characters are held back
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # Set with finish_reason="error": the failure as one of our errors (status, type, code, param,
    # a message safe to show), so every answer shape (SSE, NDJSON, JSON, a batch line) tells it
    # alike, through api/errors.py.
    error: LocalserveError | None = None


def check_request(request: GenerationRequest, n_ctx_per_seq: int, n_vocab: int) -> None:
    """The refusals every engine applies at submit, before any work: InvalidRequestError or
    ContextLengthExceededError (400s) naming the field. Shared by engine.Engine and the
    onnxruntime-genai engine, so both refuse alike."""
    n = len(request.prompt_tokens)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if n >= n_ctx_per_seq:
        raise ContextLengthExceededError(
            f"the prompt has {n} tokens but this model's context holds {n_ctx_per_seq} "
            "tokens of prompt and completion together",
            param="prompt",
        )
    if request.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
    # Negative ids are image positions (media_ids.py), which only a request with images may hold; the
    # engine that holds them checks they belong to its images.
    if n_vocab and any(t >= n_vocab or (t < 0 and not request.images) for t in request.prompt_tokens):
        raise InvalidRequestError("the prompt contains token ids outside the vocabulary", param="prompt")
    if request.lane not in LANES:
        raise InvalidRequestError(f"unknown priority lane {request.lane!r}", param="priority")
    if request.thinking is not None:
        _check_thinking(request.thinking, n_vocab)
    # The bounds every entry point shares; the server checked them before loading the model, a
    # direct caller (a benchmark, a batch runner) gets the same refusal here.
    request.sampling.validate(n_vocab or None)


def _check_thinking(thinking: Thinking, n_vocab: int) -> None:
    if thinking.budget is not None and thinking.budget < 0:
        raise InvalidRequestError(f"the reasoning budget must not be negative (got {thinking.budget})",
                                  param="reasoning_budget")
    ids = thinking.end + thinking.start
    if not thinking.end or (n_vocab and any(t < 0 or t >= n_vocab for t in ids)):
        raise InvalidRequestError("the end-of-think tokens are missing or outside the vocabulary",
                                  param="reasoning_budget")
