"""The disk a batch may need, checked when it is created (507 there rather than a batch whose
results could not be written hours later).

A batch's bytes reach the disk three times: its lines are copied into SQLite at create, every
answer is recorded in SQLite as it arrives, and the output and error files are written from those
rows at finalize. So create asks for the input plus twice the worst-case output, on top of the
`batch_min_free_disk` that every batch write keeps free.

The worst case of one line is what its own fields allow, not a typical answer: a refused create
costs a user one retry, a batch that cannot be written costs them its wait. Chat, completions and
Responses may generate `max_tokens` (`max_output_tokens`; left out, the whole context) per choice;
embeddings one vector per input; rerank one result per document, each echoing its document. A finalize that still finds too little room keeps its results
(runner.py), so this is the early answer, not the only guard.
"""

from __future__ import annotations

import json
from typing import Any

LINE_OVERHEAD = 1024  # ids, usage, finish reason and the object's other fields, as JSON
TOKEN_BYTES = 16  # one generated token as JSON text: long tokens and \\uXXXX escapes included
LOGPROB_BYTES = 64  # one {"token", "logprob", "bytes": [...]} entry per token and alternative
EMBED_DIMS = 4096  # dimensions assumed when a line does not ask for fewer (a 7B model's width)
FLOAT_BYTES = 22  # one float as JSON text ("-0.012345678901234567,")
RESULT_BYTES = 96  # one rerank result without its document: {"index", "relevance_score"} as JSON
DEFAULT_CONTEXT = 8192  # what context_length = 0 gives at most (config.py)


def worst_output(line: dict[str, Any], context_length: int) -> int:
    """Bytes of the largest answer `line` (a parsed batch line) could get, as one JSONL line."""
    body = line.get("body")
    if not isinstance(body, dict):
        return LINE_OVERHEAD  # answered with an error body
    if line.get("url") == "/v1/embeddings":
        return LINE_OVERHEAD + _embeddings(body)
    if line.get("url") == "/v1/rerank":
        return LINE_OVERHEAD + _rerank(body)
    return LINE_OVERHEAD + _generated(body, context_length or DEFAULT_CONTEXT)


def _count(value: Any, default: int, cap: int) -> int:
    """A client's number, as the endpoint would clamp it (anything odd: the endpoint refuses it,
    and its error line is small, so the default is a safe over-estimate)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return default
    return min(value, cap)


def _generated(body: dict[str, Any], context: int) -> int:
    asked = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    tokens = _count(asked, context, context)
    choices = _count(body.get("n"), 1, 128)
    logprobs = body.get("top_logprobs", body.get("logprobs"))
    alternatives = 0 if logprobs in (None, False) else 1 + _count(logprobs, 0, 20)
    return choices * tokens * (TOKEN_BYTES + alternatives * LOGPROB_BYTES)


def _embeddings(body: dict[str, Any]) -> int:
    inputs = body.get("input")
    count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
    return count * _count(body.get("dimensions"), EMBED_DIMS, EMBED_DIMS) * FLOAT_BYTES


def _rerank(body: dict[str, Any]) -> int:
    documents = body.get("documents", body.get("texts"))
    if not isinstance(documents, list):
        return 0  # refused: an error line
    return len(json.dumps(documents, ensure_ascii=False)) + len(documents) * RESULT_BYTES
