"""Tool calls parsed back from model output: Hermes/Qwen <tool_call> blocks, plain JSON, streaming."""

from __future__ import annotations

import json

import pytest

from localserve.api.tools import ToolCallStream, forced_call_schema, parse_tool_calls
from localserve.api.validation import parse_messages, parse_tool_call_arguments, parse_tool_choice, parse_tools
from localserve.errors import InvalidRequestError

TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
])

# Recorded Qwen2.5-Instruct answers (shape as the model emits them).
QWEN_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN_TWO = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def names_and_args(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_blocks():
    content, calls = parse_tool_calls(QWEN_ONE, TOOLS)
    assert content == "" and names_and_args(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = parse_tool_calls(QWEN_TWO, TOOLS)
    assert content == "Let me check both."
    assert names_and_args(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_missing_closing_tag_at_end_of_generation():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', TOOLS)
    assert names_and_args(calls) == [("add", {"a": 1, "b": 2})]


def test_plain_json_forms():
    for text in ['{"name": "add", "arguments": {"a": 1, "b": 2}}',
                 '  {"name": "add", "parameters": {"a": 1, "b": 2}}\n',  # Llama 3.x
                 '```json\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n```',
                 '[{"name": "add", "arguments": {"a": 1, "b": 2}}]']:
        content, calls = parse_tool_calls(text, TOOLS)
        assert names_and_args(calls) == [("add", {"a": 1, "b": 2})], text
        assert content == ""


def test_not_a_call_stays_text():
    for text in ['{"city": "Paris"}',  # JSON data, not a call
                 '{"name": "delete_everything", "arguments": {}}',  # not one of the request's tools
                 "<tool_call>\n{not json}\n</tool_call>",
                 "The weather is fine."]:
        assert parse_tool_calls(text, TOOLS) == (text, [])
    assert parse_tool_calls(QWEN_ONE, []) == (QWEN_ONE, [])


def test_streaming_holds_back_possible_calls():
    stream = ToolCallStream(TOOLS)
    pieces = ["Let me ", "check.\n<to", "ol_call>\n{\"name\": \"add\", ", "\"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"]
    sent = "".join(stream.feed(p) for p in pieces)
    assert sent == "Let me check.\n"
    rest, calls = stream.finish()
    assert rest == "" and names_and_args(calls) == [("add", {"a": 1, "b": 2})]

    plain = ToolCallStream(TOOLS)
    sent = "".join(plain.feed(p) for p in ["Hello", " <b>", "world</b>", " <"])
    rest, calls = plain.finish()
    assert sent + rest == "Hello <b>world</b> <" and calls == []

    data = ToolCallStream(TOOLS)
    assert data.feed('{"city":') == "" and data.feed(' "Rome"}') == ""
    assert data.finish() == ('{"city": "Rome"}', [])


def test_forced_call_schema_and_tool_choice():
    one = forced_call_schema(TOOLS[:1])
    assert one["properties"]["name"] == {"const": "get_weather"} and one["required"] == ["name", "arguments"]
    assert len(forced_call_schema(TOOLS)["anyOf"]) == 2
    assert parse_tool_choice(None, TOOLS) == "auto"
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS) is TOOLS[1]
    for bad in ["sometimes", {"type": "function", "function": {"name": "nope"}}]:
        with pytest.raises(InvalidRequestError):
            parse_tool_choice(bad, TOOLS)
    with pytest.raises(InvalidRequestError):
        parse_tool_choice("required", [])
    with pytest.raises(InvalidRequestError) as e:
        parse_tools([{"type": "function", "function": {"parameters": {}}}])
    assert e.value.param == "tools[0].function.name"


def test_a_model_call_with_an_integer_python_cannot_read_stays_text():
    """A model that writes a 5,000-digit integer into a call's arguments (valid JSON, past Python's
    int-string limit) answered a 500 after generating; it is text, as any unreadable call is."""
    digits = "9" * 5000
    for text in ['<tool_call>\n{"name": "add", "arguments": {"a": ' + digits + '}}\n</tool_call>',
                 '{"name": "add", "arguments": {"a": ' + digits + '}}',
                 '{"name": "add", "arguments": "{\\"a\\": ' + digits + '}"}']:
        content, calls = parse_tool_calls(text, TOOLS)
        assert calls == [], text[:40]
    from localserve.api.tools import ToolCall

    assert ToolCall(name="add", arguments='{"a": ' + digits + "}").ollama()["function"]["arguments"] == {}


def test_tool_call_arguments_python_cannot_hold_stay_as_they_came():
    """Review 4 #9: a 5,000-digit integer is valid JSON that Python's int limit refuses
    (ValueError, not JSONDecodeError), and deep nesting hits the recursion limit; either was a 500."""
    assert parse_tool_call_arguments('{"a": 1}') == {"a": 1}
    assert parse_tool_call_arguments("not json") == "not json"
    for text in ['{"n": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000]:
        assert parse_tool_call_arguments(text) == text
    big = '{"n": ' + "9" * 5000 + "}"
    messages = parse_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": big}}]}])
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == big
