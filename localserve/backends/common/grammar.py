"""Constrained output: the GBNF text for a request (a grammar given as is, or a JSON schema compiled).

The schema compiler is llama-cpp-python's port of llama.cpp's json-schema-to-grammar; we call it
rather than maintain our own, with the one place it differs from llama.cpp's put back: what may
stand inside a JSON string (`_JsonStringsConverter`). `{}` (OpenAI's `response_format:
json_object`) means "any JSON object".
Every schema and grammar passes schema_bounds first, and a compiled grammar again: both the
compiler and llama.cpp's parser amplify their input, and the parser can overflow the C stack.
"""

from __future__ import annotations

import functools
import json

from llama_cpp.llama_grammar import DOT, JSON_GBNF, PRIMITIVE_RULES, SchemaConverter

from ...protocol.requests import SamplingParams
from ...errors import InvalidRequestError
from .schema_bounds import MAX_COMPILED_GRAMMAR_CHARS, check_grammar, check_schema

# JSON_GBNF's root is `object`: exactly "any JSON object".
ANY_JSON_OBJECT_GBNF = JSON_GBNF

# Capabilities.constraints of a backend that samples through llama.cpp's grammar sampler (llama.cpp,
# ONNX): GBNF as given, JSON schemas compiled to GBNF here.
GRAMMAR_CONSTRAINTS = frozenset({"gbnf", "json_schema"})

# A string's character as JSON allows it unescaped: no control character (U+0000-U+001F, and U+007F
# as llama.cpp's converter also leaves out), no quote, no backslash. The port's `char` is
# `[^"\\]`: at temperature 1 a raw newline landed inside a string, 1 seed in 12 ended `stop` with
# text json.loads refuses (issue 47).
_STRING_CHAR = r'[^"\\\x7F\x00-\x1F]'
_JSON_CHAR = _STRING_CHAR + r' | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
# A `pattern`'s `.` stands inside the same string: the port's `[^\x0A\x0D]` let a quote end it
# early, or a tab or backspace in raw.
_FIXED_RULES = {("char", PRIMITIVE_RULES["char"].content): _JSON_CHAR, ("dot", DOT): _STRING_CHAR}

_MAX_CACHED_SCHEMA_CHARS = 64 * 1024  # the cache keeps its keys: 64 bodies' worth of schema is too much


def grammar_text(params: SamplingParams) -> str | None:
    """The GBNF for `params`, or None when the output is unconstrained."""
    if params.grammar is not None and params.json_schema is not None:
        raise InvalidRequestError("give either a grammar or a JSON schema, not both", param="grammar")
    if params.grammar is not None:
        if not params.grammar.strip():
            raise InvalidRequestError("grammar is empty", param="grammar")
        check_grammar(params.grammar, "grammar")
        return params.grammar
    if params.json_schema is not None:
        param = params.constraint_param
        if not isinstance(params.json_schema, dict):
            raise InvalidRequestError("JSON schema must be an object", param=param)
        if not params.json_schema:
            return ANY_JSON_OBJECT_GBNF
        check_schema(params.json_schema, param)  # before json.dumps and the compiler, which recurse
        try:
            text = json.dumps(params.json_schema)  # key order kept: it is the output property order
        except (TypeError, ValueError):
            raise InvalidRequestError("JSON schema is not serialisable JSON", param=param) from None
        compile_ = _compile_cached if len(text) <= _MAX_CACHED_SCHEMA_CHARS else _compile_schema
        return compile_(text, param)
    return None


class _JsonStringsConverter(SchemaConverter):
    """The port's converter with llama.cpp's string characters (_FIXED_RULES)."""

    def _add_rule(self, name: str, rule: str) -> str:
        return super()._add_rule(name, _FIXED_RULES.get((name, rule), rule))


def json_schema_to_gbnf(schema_json: str) -> str:
    """GBNF for a JSON schema, as llama-cpp-python's function of that name with JSON's own strings."""
    converter = _JsonStringsConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(json.loads(schema_json), "stdin"), "")
    return converter.format_grammar()


def _compile_schema(schema_json: str, param: str) -> str:
    try:
        gbnf = json_schema_to_gbnf(schema_json)
    except Exception as e:  # noqa: BLE001 - the converter raises bare Exception/KeyError/ValueError/...
        raise InvalidRequestError(f"unsupported JSON schema: {e}", param=param) from None
    check_grammar(gbnf, param, max_chars=MAX_COMPILED_GRAMMAR_CHARS)
    return gbnf


# Clients tend to send the same schema with every request; compiling is pure, so cache it.
_compile_cached = functools.lru_cache(maxsize=64)(_compile_schema)
