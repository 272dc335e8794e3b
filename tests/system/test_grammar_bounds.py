"""Bounded constrained decoding (schema_bounds): the checker on its own, the real llama.cpp parser
behind it, and the real server refusing the inputs that used to kill the daemon (SIGSEGV from a
`maxLength: 1000000` schema) with a 400 in each API's own shape."""

from __future__ import annotations

import json

import pytest

from localserve.backends.common import schema_bounds
from localserve.backends.common.grammar import ANY_JSON_OBJECT_GBNF, grammar_text
from localserve.protocol.requests import SamplingParams
from localserve.errors import InvalidRequestError
from localserve.backends.common.schema_bounds import (
    BOUND_KEYWORDS,
    MAX_GRAMMAR_DEPTH,
    MAX_REPEAT,
    MAX_SCHEMA_DEPTH,
    check_grammar,
    check_schema,
)
from server_harness import MODEL, LiveServer, install_model, server_settings

CRASH_STRING = {"type": "string", "maxLength": 1_000_000}
CRASH_ARRAY = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}}}
HUGE_MIN_ITEMS = {"type": "array", "items": {"type": "integer"}, "minItems": 4_000_000}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _refused(schema, param="response_format") -> str:
    with pytest.raises(InvalidRequestError) as info:
        check_schema(schema, param)
    assert info.value.param == param
    return str(info.value)


# --- the schema walker ---------------------------------------------------------------------------
@pytest.mark.parametrize("keyword", BOUND_KEYWORDS)
def test_each_bound_keyword_is_capped(keyword):
    check_schema({"type": "string", keyword: MAX_REPEAT}, "response_format")
    message = _refused({"type": "string", keyword: MAX_REPEAT + 1})
    assert keyword in message and str(MAX_REPEAT) in message
    _refused({"properties": {"x": {keyword: 10**30}}}, "format")


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True, None, float("nan")])
def test_bounds_must_be_non_negative_integers(bad):
    _refused({"type": "array", "maxItems": bad})


def test_keyword_names_as_property_names_and_data_are_not_bounds():
    check_schema({"type": "object", "properties": {"maxLength": {"type": "string"}, "minItems": {"type": "integer"}}},
                 "response_format")
    check_schema({"const": {"maxLength": 10**9}, "enum": [{"minItems": -5}], "default": {"maxItems": "x"}}, "format")


def test_deep_nesting_is_refused_without_recursion():
    check_schema(_nested(MAX_SCHEMA_DEPTH // 3), "response_format")
    assert "deeper" in _refused(_nested(600))
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit: the walker has no recursion
        deep = [deep]
    assert "deeper" in _refused({"enum": deep})


def test_too_many_nodes_and_properties_are_refused():
    assert "parts" in _refused({"enum": list(range(schema_bounds.MAX_SCHEMA_NODES + 1))})
    many = {f"p{i}": {"type": "integer"} for i in range(schema_bounds.MAX_PROPERTIES + 1)}
    assert "properties" in _refused({"type": "object", "properties": many})


def test_many_legal_bounds_together_are_refused():
    props = {f"p{i}": {"type": "string", "maxLength": MAX_REPEAT} for i in range(70)}
    assert "add up" in _refused({"type": "object", "properties": props})


@pytest.mark.parametrize("pattern", [
    "^a{0,1000000}$", "^a{1001}$", "^a{3,99999999999999999999}$", "^" + "(" * 80 + "a" + ")" * 80 + "$",
    "^" + "a" * (schema_bounds.MAX_PATTERN_CHARS + 1) + "$",
])
def test_patterns_are_bounded(pattern):
    _refused({"type": "string", "pattern": pattern})


def test_pattern_escapes_and_classes_do_not_count_as_groups():
    check_schema({"type": "string", "pattern": r"^[(((((]" + r"\(" * 100 + f"a{{2,{MAX_REPEAT}}}$"}, "response_format")


def test_big_but_legal_schemas_compile_within_the_caps():
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 64}, "minItems": 1, "maxItems": MAX_REPEAT},
            "name": {"type": "string", "minLength": 1, "maxLength": MAX_REPEAT},
            "code": {"type": "string", "pattern": "^[A-Z]{2,8}-[0-9]{4}$"},
            "nested": _nested(10),
        },
        "required": ["tags", "name"],
    }
    gbnf = grammar_text(SamplingParams(json_schema=schema))
    assert "root ::=" in gbnf and len(gbnf) < schema_bounds.MAX_COMPILED_GRAMMAR_CHARS
    check_grammar(gbnf, "response_format", max_chars=schema_bounds.MAX_COMPILED_GRAMMAR_CHARS)


def test_empty_schema_still_means_any_object():
    assert grammar_text(SamplingParams(json_schema={})) == ANY_JSON_OBJECT_GBNF


def test_grammar_text_names_the_field_the_schema_came_from():
    for params in (SamplingParams(json_schema=CRASH_STRING, constraint_param="format"),
                   SamplingParams(json_schema=HUGE_MIN_ITEMS, constraint_param="tools")):
        with pytest.raises(InvalidRequestError) as info:
            grammar_text(params)
        assert info.value.param == params.constraint_param


# --- the GBNF scanner ----------------------------------------------------------------------------
def _grammar_refused(text: str) -> str:
    with pytest.raises(InvalidRequestError) as info:
        check_grammar(text, "grammar")
    assert info.value.param == "grammar"
    return str(info.value)


def test_grammar_nesting_is_capped():
    ok = "root ::= " + "(" * MAX_GRAMMAR_DEPTH + '"a"' + ")" * MAX_GRAMMAR_DEPTH
    check_grammar(ok, "grammar")
    assert "deeper" in _grammar_refused("root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000)


def test_parentheses_in_literals_classes_tokens_and_comments_are_not_groups():
    text = 'root ::= "' + "(" * 5000 + '" [(((\\]] # ' + "(" * 5000 + '\nx ::= "\\"((("'
    check_grammar(text, "grammar")


@pytest.mark.parametrize("text", [
    'root ::= "a"{1000000}', 'root ::= "a"{0,99999999}', 'root ::= [a-z]{2001}',
    'root ::= "' + "x" * 20_000 + '"{2000}',  # a long literal copied 2000 times: ~320 MB of rules
    "root ::= " + ' "a"{2000}' * 2100,
])
def test_grammar_repetitions_are_bounded(text):
    _grammar_refused(text)


def test_grammar_size_is_capped():
    assert "longer" in _grammar_refused('root ::= "' + "a" * schema_bounds.MAX_GRAMMAR_CHARS + '"')
    check_grammar('root ::= [a-z]{1,2000} "(" x{3} ")"\nx ::= "y"', "grammar")


# --- the real llama.cpp parser ------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    from llamacpp_helpers import load

    b = load(smollm2_gguf, exact=True)
    yield b
    b.close()


@pytest.mark.model
def test_llamacpp_parses_the_largest_legal_grammars(backend):
    # At the caps, the native parser (on its big-stack thread) parses without trouble.
    deepest = "root ::= " + "(" * MAX_GRAMMAR_DEPTH + '"a"' + ")" * MAX_GRAMMAR_DEPTH
    for params in (SamplingParams(grammar=deepest),
                   SamplingParams(json_schema={"type": "string", "maxLength": MAX_REPEAT}),
                   SamplingParams(json_schema={"type": "array", "items": {"type": "integer"}, "maxItems": MAX_REPEAT})):
        backend.new_sampler(params, backend.tokenize("x")).close()


@pytest.mark.model
def test_crash_inputs_are_refused_before_llamacpp(backend):
    for params in (SamplingParams(json_schema=CRASH_STRING), SamplingParams(json_schema=CRASH_ARRAY),
                   SamplingParams(json_schema=HUGE_MIN_ITEMS),
                   SamplingParams(grammar="root ::= " + "(" * 200_000 + '"a"' + ")" * 200_000),
                   SamplingParams(grammar='root ::= "' + "x" * 50_000 + '"{2000}')):
        with pytest.raises(InvalidRequestError):
            backend.new_sampler(params, backend.tokenize("x"))


# --- the real server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    settings = server_settings(tmp_path_factory.mktemp("home"))
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        yield live


def _openai_schema(schema: dict) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _forced_tool(parameters: dict) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


def _assert_openai_400(server, body: dict, param: str) -> None:
    status, _, raw = server.request("POST", "/v1/chat/completions", body, timeout=30)
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "Traceback" not in raw.decode() and "site-packages" not in raw.decode()


NORMAL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.model
def test_server_refuses_the_crash_inputs_and_keeps_serving(server):
    before = server.json("POST", "/v1/chat/completions", _openai_schema(NORMAL_SCHEMA))
    assert before[0] == 200
    for schema in (CRASH_STRING, CRASH_ARRAY, HUGE_MIN_ITEMS, _nested(40)):  # 40: 81 JSON levels
        _assert_openai_400(server, _openai_schema(schema), "response_format")
    # 600 levels, as the issue sent it (a 500 before; json.dumps would recurse too deep to write it).
    # The body's own nesting limit may refuse it before the schema check: either way a 400.
    deep = '{"type": "array", "items": ' * 600 + "{}" + "}" * 600
    raw = json.dumps(_openai_schema({})).replace('"schema": {}', f'"schema": {deep}').encode()
    status, _, answer = server.request("POST", "/v1/chat/completions", raw=raw, timeout=30)
    assert status == 400 and set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}, answer[:300]
    for parameters in (CRASH_ARRAY, {"type": "object", "properties": {"s": CRASH_STRING}}, HUGE_MIN_ITEMS):
        _assert_openai_400(server, _forced_tool(parameters), "tools")
    for schema in (CRASH_STRING, CRASH_ARRAY, HUGE_MIN_ITEMS):
        for path, extra in (("/api/chat", {"messages": [{"role": "user", "content": "Hi"}]}),
                            ("/api/generate", {"prompt": "Hi"})):
            status, body = server.json("POST", path, {"model": MODEL, "stream": False, "format": schema, **extra})
            assert status == 400 and isinstance(body["error"], str) and "format" in body["error"], body
    after = server.json("POST", "/v1/chat/completions", _openai_schema(NORMAL_SCHEMA))
    assert after[0] == 200
    assert after[1]["choices"][0]["message"] == before[1]["choices"][0]["message"]  # greedy: same answer


@pytest.mark.model
def test_server_constrained_output_still_works(server):
    status, body = server.json("POST", "/v1/chat/completions", {
        **_openai_schema({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}),
        "max_tokens": 40, "messages": [{"role": "user", "content": "Name a city in France as JSON."}]})
    assert status == 200
    content = body["choices"][0]["message"]["content"]
    if body["choices"][0]["finish_reason"] == "stop":
        parsed = json.loads(content)
        assert isinstance(parsed["city"], str) and len(parsed["city"]) <= 20
    status, body = server.json("POST", "/api/chat", {
        "model": MODEL, "stream": False, "format": NORMAL_SCHEMA, "options": {"temperature": 0, "num_predict": 20},
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]})
    assert status == 200 and body["message"]["content"].lstrip().startswith("{")
