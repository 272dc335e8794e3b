"""What a caller asks of an engine (GenerationRequest, SamplingParams) and what it gets back (events).

The product's neutral vocabulary, below every package that uses it: server/ builds these from HTTP
bodies, engines (engine.py, or one that batches by itself) consume them, backends/ sample by
SamplingParams, batching/ schedules by lane. They carry token ids, never HTTP or backend objects.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

Lane = Literal["interactive", "default", "batch"]
LANES: tuple[Lane, ...] = ("interactive", "default", "batch")  # highest priority first
LANE_RANK: dict[str, int] = {lane: rank for rank, lane in enumerate(LANES)}  # 0 = highest priority

FinishReason = Literal["stop", "length", "cancelled", "error"]

_request_ids = itertools.count(1)


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


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings: found across token boundaries, never emitted
    lane: Lane = "default"
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")


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
    error: str | None = None  # set with finish_reason="error"; safe to show a client
