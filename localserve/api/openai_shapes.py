"""The pieces every OpenAI response object is made of, whole or streamed: the id, timestamp and
fingerprint each object of one response carries (`Head`), the logprobs in chat's and in
completions' shapes, and the finish reason. api/openai.py builds whole answers from them and
server/openai_routes.py the SSE chunks, so the two cannot drift apart.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from .. import __version__
from ..protocol.requests import TokenLogprob

SYSTEM_FINGERPRINT = f"localserve-{__version__}"
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a number
CHAT_PREFIX, COMPLETION_PREFIX = "chatcmpl", "cmpl"  # of response ids


def finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def chat_logprobs(items: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.text,
                "logprob": _lp(lp.logprob),
                "bytes": list(lp.text.encode("utf-8")),
                "top_logprobs": [
                    {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}
                    for _, text, value in lp.top[:k]
                ],
            }
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[TokenLogprob], k: int, offset: int) -> dict[str, Any]:
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.text)
    return {
        "tokens": [lp.text for lp in items],
        "token_logprobs": [_lp(lp.logprob) for lp in items],
        "top_logprobs": [{text: _lp(value) for _, text, value in lp.top[:k]} for lp in items],
        "text_offset": offsets,
    }


@dataclass
class Head:
    """The id, timestamp and model every object of one response carries."""

    model: str
    prefix: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex[:24]}"

    def of(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}
