"""Constrained output: the GBNF text for a request (a grammar given as is, or a JSON schema compiled).

The schema compiler is llama-cpp-python's port of llama.cpp's json-schema-to-grammar; we call it
rather than maintain our own. `{}` (OpenAI's `response_format: json_object`) means "any JSON object".
"""

from __future__ import annotations

import functools
import json

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from ..batching.params import SamplingParams
from ..errors import InvalidRequestError

# JSON_GBNF's root is `object`: exactly "any JSON object".
ANY_JSON_OBJECT_GBNF = JSON_GBNF

MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar is parsed on every request; bound the work one body can cause


def grammar_text(params: SamplingParams) -> str | None:
    """The GBNF for `params`, or None when the output is unconstrained."""
    if params.grammar is not None and params.json_schema is not None:
        raise InvalidRequestError("give either a grammar or a JSON schema, not both", param="grammar")
    if params.grammar is not None:
        if not params.grammar.strip():
            raise InvalidRequestError("grammar is empty", param="grammar")
        if len(params.grammar) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError("grammar is too long", param="grammar")
        return params.grammar
    if params.json_schema is not None:
        if not isinstance(params.json_schema, dict):
            raise InvalidRequestError("JSON schema must be an object", param="response_format")
        if not params.json_schema:
            return ANY_JSON_OBJECT_GBNF
        try:
            text = json.dumps(params.json_schema)  # key order kept: it is the output property order
        except (TypeError, ValueError):
            raise InvalidRequestError("JSON schema is not serialisable JSON", param="response_format") from None
        return _compile_schema(text)
    return None


@functools.lru_cache(maxsize=64)
def _compile_schema(schema_json: str) -> str:
    # Clients tend to send the same schema with every request; compiling is pure, so cache it.
    try:
        return json_schema_to_gbnf(schema_json)
    except Exception as e:  # noqa: BLE001 - the converter raises bare Exception/KeyError/ValueError/...
        raise InvalidRequestError(f"unsupported JSON schema: {e}", param="response_format") from None
