"""What a batch input file must be, checked when the batch is created.

Refused with a 400 naming the first offending line (nothing is queued): a file over
batch_max_file_bytes or batch_max_lines, text that is not UTF-8, a file in which no line is JSON
at all (CSV, prose: not JSONL), a JSON line that is not an object with a string `custom_id` (its
answer could not be told apart from the others), a `custom_id` used twice.

Kept, to be answered in the error file with the body the endpoint would give: a line that is not
valid JSON in an otherwise JSONL file (its custom_id is unknown: null in the error line), and
every line whose url, method or body is wrong -- one bad line must not sink a batch of thousands.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidRequestError

MAX_CUSTOM_ID = 512
Line = tuple[str | None, str]  # (custom_id, the raw line)


def refuse(number: int, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"input file line {number}: {problem}", param="input_file_id")


def read_input(path: Path, max_bytes: int, max_lines: int) -> list[Line]:
    lines: list[Line] = []
    seen: dict[str, int] = {}
    first_bad: int | None = None
    size = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            size += len(raw)
            if size > max_bytes:
                raise refuse(number, f"the file is larger than {max_bytes} bytes (setting batch_max_file_bytes)")
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise refuse(number, "not UTF-8 text; the input must be JSONL") from None
            if not text:
                continue
            if len(lines) == max_lines:
                raise refuse(number, f"more than {max_lines} requests (setting batch_max_lines)")
            custom_id = _custom_id(number, text, seen)
            if custom_id is None and first_bad is None:
                first_bad = number
            lines.append((custom_id, text))
    if not lines:
        raise InvalidRequestError("the input file holds no requests", param="input_file_id")
    if all(cid is None for cid, _ in lines):
        raise refuse(first_bad or 1, "not JSON; the input must be JSONL (one JSON request object a line)")
    return lines


def _custom_id(number: int, text: str, seen: dict[str, int]) -> str | None:
    """The line's custom_id; None for a line that is not JSON (answered in the error file)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        raise refuse(number, "not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise refuse(number, f"'custom_id' must be a string of 1..{MAX_CUSTOM_ID} characters")
    if custom_id in seen:
        raise refuse(number, f"custom_id {custom_id[:80]!r} repeats line {seen[custom_id]}")
    seen[custom_id] = number
    return custom_id
