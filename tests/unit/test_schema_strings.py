"""A JSON schema's strings compile to JSON's own strings (backends/common/grammar.py, issue 47 item 1):
no raw control character, quote or backslash inside a string, in a plain string and in a pattern's `.`."""

from __future__ import annotations

import json

from localserve.backends.common.grammar import json_schema_to_gbnf

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "code": {"type": "string", "pattern": "^a.b$"}},
          "required": ["name", "code"]}


def rules(schema: dict) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in json_schema_to_gbnf(json.dumps(schema)).splitlines())


def test_a_strings_character_leaves_out_control_characters_as_llama_cpp_does() -> None:
    got = rules(PERSON)
    assert got["char"].startswith(r'[^"\\\x7F\x00-\x1F] | "\\" ')  # the port's was [^"\\]: a raw newline passed
    assert got["dot"] == r'[^"\\\x7F\x00-\x1F]'  # the port's [^\x0A\x0D] let a quote end the string
