"""The shape of a JSON body, checked before and while it is parsed; no socket here (server/body.py
reads the bytes within their size and time bounds).

- JSON nested deeper than MAX_JSON_DEPTH is refused (400) before it is parsed: `json.loads` and
  every later walk over the data (schema compilers, templates, `json.dumps`) recurse per level,
  and a RecursionError deep inside one of them would be a 500;
- an integer literal longer than MAX_INT_DIGITS is refused (400): Python refuses to convert one
  over 4300 digits with a ValueError (sys.set_int_max_str_digits), and shorter ones still cost
  quadratic time to convert while no field of either API needs more than 20 digits.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import InvalidRequestError


MAX_JSON_DEPTH = 128


MAX_INT_DIGITS = 256


_BRACKETS = np.frombuffer(b"[]{}", dtype=np.uint8)


class BodyTooLargeError(InvalidRequestError):
    http_status = 413
    code = "request_too_large"


class BodyTimeoutError(InvalidRequestError):
    http_status = 408
    code = "request_timeout"


def body_too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"request body is larger than {limit} bytes (setting max_body_bytes)")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw`, counted without recursion or regular
    expressions (a regex over strings retries an unterminated one from every later quote: minutes
    for a few hundred kB of `\\"`), in a few linear passes that take milliseconds for 8 MB."""
    # Escaped backslashes first (pairs from the left, as a JSON reader takes them), then escaped
    # quotes: every quote left opens or closes a string.
    text = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    codes = np.frombuffer(text, dtype=np.uint8)
    inside = np.bitwise_xor.accumulate(codes == 0x22)  # True from an opening quote to its closing one
    brackets = codes[~inside & np.isin(codes, _BRACKETS)]
    if not brackets.size:
        return 0
    # '[' 0x5B and '{' 0x7B have bit 1 set, ']' 0x5D and '}' 0x7D do not.
    steps = ((brackets >> 1) & 1).astype(np.int8) * 2 - 1
    return int(np.cumsum(steps, dtype=np.int32).max())


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidRequestError(f"request body has an integer with more than {MAX_INT_DIGITS} digits", param=None)
    return int(text)


def parse_json(raw: bytes) -> Any:
    """`raw` parsed as JSON, every malformed or hostile input an InvalidRequestError (400)."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw, parse_int=_bounded_int)
    except UnicodeDecodeError:
        raise InvalidRequestError("request body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise InvalidRequestError(
            f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except (ValueError, RecursionError):  # belt and braces: the checks above should stop both
        raise InvalidRequestError("request body is not valid JSON") from None
