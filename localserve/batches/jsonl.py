"""What a batch input file must be, checked when the batch is created.

Refused with a 400 naming the first offending line (nothing is queued): a file over
batch_max_file_bytes or batch_max_lines, a line over max_body_bytes (the same request over HTTP is
a 413 before a byte of it is parsed, and a line must not be the way round that limit: read whole,
it would be parsed and tokenized in full), text that is not UTF-8, a file in which no line is JSON
at all (CSV, prose: not JSONL), a JSON line that is not an object with a string `custom_id` (its
answer could not be told apart from the others), a `custom_id` used twice.

Kept, to be answered in the error file with the body the endpoint would give: a line that is not
valid JSON in an otherwise JSONL file (its custom_id is unknown: null in the error line), and
every line whose url, method or body is wrong -- one bad line must not sink a batch of thousands.
A line whose body the endpoint refuses (a 5,000-digit integer, say) keeps its custom_id: only the
custom_id has to be readable here, not every value.

Read in a worker thread (runner.create): this parses every line once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.settings import Settings
from ..errors import InvalidRequestError
from .room import worst_output

MAX_CUSTOM_ID = 512
MAX_MODELS = 64  # distinct models a batch records for the runner's queues; more count as "any"
Line = tuple[str | None, str]  # (custom_id, the raw line)


@dataclass
class BatchInput:
    lines: list[Line] = field(default_factory=list)
    models: set[str] | None = field(default_factory=set)  # None: more than MAX_MODELS
    input_bytes: int = 0
    worst_output_bytes: int = 0  # room.worst_output summed over the lines


def refuse(number: int, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"input file line {number}: {problem}", param="input_file_id")


def read_input(path: Path, settings: Settings) -> BatchInput:
    """The checked lines of an input file, the models they name and the room their answers may need."""
    max_bytes, max_lines, max_line = settings.batch_max_file_bytes, settings.batch_max_lines, settings.max_body_bytes
    out = BatchInput()
    lines = out.lines
    seen: dict[str, int] = {}
    first_bad: int | None = None
    number = 0
    with open(path, "rb") as f:
        # At most max_line + 3 bytes at a time (the line, its \r\n and one more to tell it is over):
        # a 190 MiB line is refused having read 8 MiB of it, not all of it.
        while raw := f.readline(max_line + 3):
            number += 1
            out.input_bytes += len(raw)
            if out.input_bytes > max_bytes:
                raise refuse(number, f"the file is larger than {max_bytes} bytes (setting batch_max_file_bytes)")
            if len(raw.rstrip(b"\r\n")) > max_line:
                raise refuse(number, f"the request is larger than {max_line} bytes, the limit of a request body "
                                     "(setting max_body_bytes)")
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise refuse(number, "not UTF-8 text; the input must be JSONL") from None
            if not text:
                continue
            if len(lines) == max_lines:
                raise refuse(number, f"more than {max_lines} requests (setting batch_max_lines)")
            obj = _parse(text)
            custom_id = None if obj is None else _custom_id(number, obj, seen)
            if custom_id is None and first_bad is None:
                first_bad = number
            lines.append((custom_id, text))
            out.worst_output_bytes += worst_output(obj or {}, settings.context_length)
            _add_model(out, obj, settings.default_model)
    if not lines:
        raise InvalidRequestError("the input file holds no requests", param="input_file_id")
    if all(cid is None for cid, _ in lines):
        raise refuse(first_bad or 1, "not JSON; the input must be JSONL (one JSON request object a line)")
    return out


def _parse(text: str) -> Any:
    """The line as JSON; None if it is not JSON. Long integers are not converted: Python refuses
    one over 4,300 digits with the same ValueError as bad JSON, which would lose a readable
    custom_id, and converting long ones costs quadratic time. (The line's own run parses it again
    with the endpoint's limits and answers such an integer with the endpoint's 400.)"""
    try:
        return json.loads(text, parse_int=_short_int)
    except (ValueError, RecursionError):
        return None


def _short_int(digits: str) -> int:
    # 0 is "not given" to room.py; no field of the APIs needs more than 20 digits (server/body.py).
    return int(digits) if len(digits) <= 20 else 0


def _add_model(out: BatchInput, obj: Any, default: str) -> None:
    if out.models is None:
        return
    body = obj.get("body") if isinstance(obj, dict) else None
    model = body.get("model") if isinstance(body, dict) else None
    out.models.add(model if isinstance(model, str) and model else default)
    if len(out.models) > MAX_MODELS:
        out.models = None


def _custom_id(number: int, obj: Any, seen: dict[str, int]) -> str:
    """The custom_id of a line that is JSON (a 400 naming the line unless it is a usable one)."""
    if not isinstance(obj, dict):
        raise refuse(number, "not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise refuse(number, f"'custom_id' must be a string of 1..{MAX_CUSTOM_ID} characters")
    if custom_id in seen:
        raise refuse(number, f"custom_id {custom_id[:80]!r} repeats line {seen[custom_id]}")
    seen[custom_id] = number
    return custom_id
