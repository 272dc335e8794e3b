"""Bounds on constrained decoding, checked before anything is compiled or handed to llama.cpp.

A JSON schema becomes GBNF (llama-cpp-python's json_schema_to_gbnf) and the GBNF is parsed by
llama.cpp's grammar parser. Both amplify: `maxLength: N` compiles to N *nested* optional groups,
`minItems: N` to N copies of the item, a regex quantifier `{m,n}` inside `pattern` likewise; and
llama.cpp's parser recurses once per nested group, so a ~300-byte schema (`maxLength: 1000000`)
overflowed the C stack and killed the whole daemon. These limits keep every input far from that:

- MAX_REPEAT (1000): any of minLength/maxLength/minItems/maxItems/minProperties/maxProperties/
  minContains/maxContains, and every `{m,n}` of a `pattern`. llama.cpp's parser itself refuses a
  group whose nested rules times its repetition pass MAX_REPETITION_THRESHOLD (2000), and an
  optional repetition (`maxLength: N`) nests two rules per level: N = 1000 is the largest that
  parses (measured), so a bigger bound could only fail later with a murkier message. Real schemas
  ask for tens or hundreds.
- MAX_GBNF_REPEAT (2000): `{m,n}` in a GBNF grammar, llama.cpp's own threshold (past it `m` is
  an error and `n` silently becomes unbounded).
- MAX_TOTAL_REPEAT (65536): the sum of a schema's bounds, so many legal bounds together cannot
  build tens of MB of grammar (each unit of bound is ~10 bytes of GBNF).
- MAX_SCHEMA_DEPTH (64) and MAX_SCHEMA_NODES (20000): the schema JSON's nesting and size; the
  compiler recurses in Python per level (a 600-deep schema was a RecursionError, a 500).
- MAX_PROPERTIES (256) per object: the compiler recurses once per optional property.
- MAX_PATTERN_CHARS (2048), pattern group nesting <= MAX_SCHEMA_DEPTH: the regex compiler also
  recurses per group.
- GBNF text (given, or compiled): MAX_GRAMMAR_CHARS (256 KiB given, 1 MiB compiled), group
  nesting <= MAX_GRAMMAR_DEPTH (MAX_REPEAT + 2 * MAX_SCHEMA_DEPTH: what a legal schema can
  compile to; the parser needs ~400 bytes of C stack per level), and MAX_GRAMMAR_ELEMENTS: llama.cpp expands `x{m,n}` by copying `x` m..n times,
  so a long literal with `{2000}` would be gigabytes; we bound the expanded size.
Even so, the native parse runs on a thread with a large stack (backends/grammar.py).

Pure functions with no recursion of their own: a hostile schema cannot blow this checker up.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import InvalidRequestError

MAX_REPEAT = 1000
MAX_GBNF_REPEAT = 2000
MAX_TOTAL_REPEAT = 1 << 16
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 20_000
MAX_PROPERTIES = 256
MAX_PATTERN_CHARS = 2048
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar given as text
MAX_COMPILED_GRAMMAR_CHARS = 1024 * 1024  # what a schema compiled to
MAX_GRAMMAR_DEPTH = MAX_REPEAT + 2 * MAX_SCHEMA_DEPTH
MAX_GRAMMAR_ELEMENTS = 1 << 22  # llama.cpp grammar elements (8 bytes each) after expanding {m,n}

BOUND_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
# Values under these keywords are JSON data, not schemas: their keys mean nothing to the compiler.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}': {message}", param=param)


def _bound(value: Any, param: str, where: str, limit: int = MAX_REPEAT) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _refuse(param, f"{where} must be a non-negative integer")
    if value > limit:
        raise _refuse(param, f"{where} is {value if value < 1e12 else 'huge'}; at most {limit} is supported")
    if value < 0 or value != int(value):
        raise _refuse(param, f"{where} must be a non-negative integer")
    return int(value)


def _quantifier_total(digits: str, param: str, where: str, limit: int = MAX_REPEAT) -> int:
    if len(digits) > 6:  # int() of thousands of digits is itself slow; anything this long is too big
        raise _refuse(param, f"a repetition in {where} is huge; at most {limit} is supported")
    return _bound(int(digits), param, f"a repetition in {where}", limit) if digits else 0


def _pattern_total(pattern: str, param: str, where: str) -> int:
    """Sum of the pattern's `{m,n}` bounds; refuses long patterns and deep group nesting."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _refuse(param, f"{where} is longer than {MAX_PATTERN_CHARS} characters")
    depth = max_depth = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            max_depth = max(max_depth, depth)
        elif ch == ")":
            depth -= 1
    if max_depth > MAX_SCHEMA_DEPTH:
        raise _refuse(param, f"{where} nests groups deeper than {MAX_SCHEMA_DEPTH}")
    total = 0
    for m in _QUANTIFIER.finditer(pattern):
        lo = _quantifier_total(m.group(1), param, where)
        hi = _quantifier_total(m.group(2) or "", param, where)
        total += max(lo, hi)
    return total


def check_schema(schema: Any, param: str) -> None:
    """Refuse (InvalidRequestError naming `param`) a JSON schema past any bound in the module doc."""
    stack: list[tuple[Any, int, bool, str]] = [(schema, 1, False, "")]  # node, depth, is data, path
    nodes = total = 0
    while stack:
        node, depth, data, path = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse(param, f"the schema has more than {MAX_SCHEMA_NODES} parts")
        if depth > MAX_SCHEMA_DEPTH and isinstance(node, (dict, list)):
            raise _refuse(param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, list):
            stack.extend((item, depth + 1, data, f"{path}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if not data:
            total += _schema_keywords(node, param, path or "/")
            if total > MAX_TOTAL_REPEAT:
                raise _refuse(param, f"the schema's length and count bounds add up to more than {MAX_TOTAL_REPEAT}")
        for key, value in node.items():
            stack.append((value, depth + 1, data or key in _DATA_KEYWORDS, f"{path}/{key}"))


def _schema_keywords(node: dict, param: str, path: str) -> int:
    total = 0
    for key in BOUND_KEYWORDS:
        if key in node and not isinstance(node[key], (dict, list)):  # a dict: a property named so
            total += _bound(node[key], param, f"{key} at {path}")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        total += _pattern_total(pattern, param, f"the pattern at {path}")
    properties = node.get("properties")
    if isinstance(properties, dict) and len(properties) > MAX_PROPERTIES:
        raise _refuse(param, f"the object at {path} has more than {MAX_PROPERTIES} properties")
    return total


def check_grammar(text: str, param: str, *, max_chars: int = MAX_GRAMMAR_CHARS) -> None:
    """Refuse GBNF that is too long, nests groups too deep, or expands `{m,n}` past the bounds.

    A scanner, not a parser: it follows llama.cpp's lexical rules (quoted literals and [classes]
    with backslash escapes, `<token>`s, `#` comments) so parentheses inside them do not count."""
    if len(text) > max_chars:
        raise _refuse(param, f"the grammar is longer than {max_chars} characters")
    depth = 0
    elements = len(text)  # each character is at most one element before expansion
    last = 1  # elements of the item a following quantifier repeats
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "\"[":
            end = _skip_quoted(text, i + 1, '"' if ch == '"' else "]")
            last, i = end - i, end
            continue
        if ch == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if ch == "<":
            end = text.find(">", i)
            i = n if end < 0 else end + 1
            last = 1
            continue
        if ch == "(":
            depth += 1
            if depth > MAX_GRAMMAR_DEPTH:
                raise _refuse(param, f"the grammar nests groups deeper than {MAX_GRAMMAR_DEPTH}")
        elif ch == ")":
            depth -= 1
            last = 1  # a group becomes one rule reference
        elif ch == "{":
            end = text.find("}", i)
            end = n if end < 0 else end
            m = _QUANTIFIER.fullmatch(text, i, min(end + 1, n))
            if m:
                lo = _quantifier_total(m.group(1), param, "the grammar", MAX_GBNF_REPEAT)
                hi = _quantifier_total(m.group(2) or "", param, "the grammar", MAX_GBNF_REPEAT)
                elements += (last + 2) * max(lo, hi, 1)
                if elements > MAX_GRAMMAR_ELEMENTS:
                    raise _refuse(param, "the grammar's repetitions expand too far")
            i = end + 1
            continue
        elif ch.isalnum() or ch in "-_":
            last = 1
        i += 1


def _skip_quoted(text: str, i: int, close: str) -> int:
    """Index just past the closing `close`, honouring backslash escapes (or the end of text)."""
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
        elif ch == close:
            return i + 1
        else:
            i += 1
    return n
