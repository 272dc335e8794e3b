"""The OpenAI Responses API (/v1/responses), end to end: the real model behind create_app on a real
local server, driven by the official `openai` package's `client.responses`, as Codex CLI and
Copilot CLI speak it. Greedy answers are compared with the same conversation sent to
/v1/chat/completions: a Responses request takes the chat path, so they must be equal.

The event splitting (reasoning, tool calls) is checked without a model at the end, on events fed
by hand, since SmolLM2 neither thinks nor calls tools unforced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import threading
import time
from pathlib import Path

import openai
import pytest

from localserve.api.openai import ApiEnv
from localserve.api.response_store import PreviousResponseNotFoundError, ResponseStore, StoredItem
from localserve.api.responses import Conversation, finished_output, parse_responses
from localserve.api.responses_stream import ResponseEvents
from localserve.api.templates import RENDER_TIME_LIMIT_S
from localserve.api.validation import Body
from localserve.config.settings import Settings
from localserve.errors import ConfigError, InvalidRequestError, NotFoundError
from localserve.protocol.requests import GenerationEvent, Usage
from server_harness import MODEL, MODEL_TAG, LiveServer, install_model, model_server, server_settings
from test_error_channel import SCHEMA, banned  # noqa: F401 - the fixture
from test_server_load import NO_EOS, assert_silent_disconnect_frees_the_slot, open_stream, slot_deadline, wait_idle

GREEDY = {"temperature": 0.0}
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
QUESTION = "What is the capital of France?"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                               "required": ["city"]}}
CHAT_WEATHER_TOOL = {"type": "function",
                     "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, messages: list, max_tokens: int, **extra) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY, **extra)
    return r.choices[0].message.content


# --- create ----------------------------------------------------------------------------------
@pytest.mark.model
def test_create_is_the_chat_answer_in_openais_shape(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model == f"{MODEL}:{MODEL_TAG}"
    assert r.status in ("completed", "incomplete")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    assert r.output_text == chat_text(client, [{"role": "user", "content": QUESTION}], 16)
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 16 and r.temperature == 0.0 and r.store is True


@pytest.mark.model
def test_instructions_and_message_items_are_the_chat_messages(client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                          {"type": "input_text", "text": "fruit."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "An apple."}]},
             {"role": "user", "content": "Another one?"}]
    r = client.responses.create(model=MODEL, instructions="You are a grocer.", input=items, max_output_tokens=12,
                                **GREEDY)
    assert r.instructions == "You are a grocer."
    assert r.output_text == chat_text(client, [
        {"role": "system", "content": "You are a grocer."}, {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Another one?"}], 12)


@pytest.mark.model
def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, stream=True, **GREEDY))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.model
def test_json_schema_text_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"capital"}
    assert r.text.format.type == "json_schema"
    loose = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, **GREEDY,
                                    text={"format": {"type": "json_object"}})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=24, response_format={"type": "json_object"}, **GREEDY)
    assert loose.output_text.startswith("{") and loose.output_text == chat.choices[0].message.content


# --- streaming -------------------------------------------------------------------------------
@pytest.mark.model
def test_stream_sends_openais_event_sequence(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, **GREEDY)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done",
                                       "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[4 + len(deltas)].text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: the prefix cache


@pytest.mark.model
def test_a_failure_before_the_first_token_is_the_same_400_streamed(server, banned):
    # A JSON schema and a logit_bias that leave no token: the engine fails before anything was sent,
    # so the stream's 200 (held for its first frame, server/held.py) never goes: the same 400.
    body = {"model": MODEL, "input": "Give me a JSON object.", "max_output_tokens": 16, "temperature": 0,
            "logit_bias": banned, "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}}
    status, whole = server.json("POST", "/v1/responses", body)
    assert status == 400 and "no token" in whole["error"]["message"], whole
    status, streamed = server.json("POST", "/v1/responses", {**body, "stream": True})
    assert status == 400 and streamed == whole


@pytest.mark.model
def test_the_sdks_stream_helper_rebuilds_the_same_response(client):
    # client.responses.stream() checks every event against the items it has seen and accumulates
    # them into the final response: an event out of order or naming a wrong item raises there.
    whole = client.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=24, **GREEDY)
    assert whole.status == "completed"  # the helper wants response.completed, not .incomplete
    with client.responses.stream(model=MODEL, input="What is 2+2?", max_output_tokens=24, **GREEDY) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL], max_output_tokens=40,
                                 tool_choice={"type": "function", "name": "get_weather"}, **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.output[-1].type == "function_call" and json.loads(final.output[-1].arguments)


@pytest.mark.model
def test_a_codex_shaped_request(server):
    # The fields Codex CLI sends (its reasoning items, prompt_cache_key, include, text.verbosity,
    # strict function tools, store false): accepted, streamed, nothing stored.
    body = {"model": MODEL, "instructions": "You are a coding agent.", "stream": True, "store": False,
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": "Be brief."}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
            "tools": [{**WEATHER_TOOL, "strict": False}], "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0b7e", "text": {"verbosity": "low"}, "max_output_tokens": 8, "temperature": 0}
    status, headers, data = server.request("POST", "/v1/responses", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    names = [line[len(b"event: "):].decode() for line in data.splitlines() if line.startswith(b"event: ")]
    events = [json.loads(line[len(b"data: "):]) for line in data.splitlines() if line.startswith(b"data: ")]
    assert names == [e["type"] for e in events] and names[0] == "response.created"
    final = events[-1]["response"]
    assert final["status"] in ("completed", "incomplete") and final["store"] is False
    assert final["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert server.json("GET", f"/v1/responses/{final['id']}")[0] == 404


# --- function calls ----------------------------------------------------------------------------
@pytest.mark.model
def test_function_call_round_trip_matches_chat(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER_TOOL], max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    chat = client.chat.completions.create(model=MODEL, messages=ask, tools=[CHAT_WEATHER_TOOL], max_tokens=40,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          **GREEDY)
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments

    # The client runs the tool and sends its output with the call, statelessly (as Codex does).
    follow = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=[WEATHER_TOOL], max_output_tokens=16,
                                     store=False, **GREEDY)
    assert answer.output[0].type == "message"
    assert answer.output_text == chat_text(client, [
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}], 16, tools=[CHAT_WEATHER_TOOL])
    # The same round trip statefully: the stored call is the conversation the output continues.
    stateful = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER_TOOL],
                                       input=[follow[-1]], max_output_tokens=16, **GREEDY)
    assert stateful.output_text == answer.output_text
    assert stateful.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.model
def test_function_call_streams_its_arguments(client):
    events = list(client.responses.create(
        model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL], max_output_tokens=40, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, **GREEDY))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds  # the call's JSON is not shown as text
    at = kinds.index("response.function_call_arguments.delta")
    assert kinds[at - 1:at + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                    "response.function_call_arguments.done", "response.output_item.done"]
    assert events[at - 1].item.type == "function_call" and events[at - 1].item.arguments == ""
    assert events[at].delta == events[at + 1].arguments == events[at + 2].item.arguments
    assert kinds[-1] == "response.completed"
    assert events[-1].response.output[-1].type == "function_call"


@pytest.mark.model
def test_hosted_tools_are_left_out_and_namespaced_functions_called_by_namespace(client):
    # Nothing runs web_search here: the model is not offered it, the answer is the tool-less one.
    r = client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}], max_output_tokens=8,
                                **GREEDY)
    assert r.output_text == chat_text(client, [{"role": "user", "content": QUESTION}], 8) and r.tools == []
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [WEATHER_TOOL]}
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=[namespace, {"type": "web_search"}],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, **GREEDY)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.namespace == "weather"
    assert [t.type for t in r.tools] == ["namespace"]


@pytest.fixture(scope="module")
def long_context(tmp_path_factory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("long"), smollm2_gguf, context_length=8192, max_sequences=2) as live:
        yield live


def _shortened(value, limit: int):
    """The recorded request with every long text cut, so it fits SmolLM2's context."""
    if isinstance(value, dict):
        return {k: _shortened(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_shortened(v, limit) for v in value]
    return value[:limit] if isinstance(value, str) else value


@pytest.mark.model
def test_codexs_recorded_request_is_answered(long_context):
    # What Codex 0.171.0 really sent (tests/fixtures/agents): function and namespace tools, the
    # hosted web_search, developer messages, reasoning, include, prompt_cache_key, client_metadata.
    body = json.loads((FIXTURES / "codex-0.171.0-responses.json").read_text())
    body = {**_shortened(body, 120), "model": MODEL, "max_output_tokens": 8, "temperature": 0}
    status, _, data = long_context.request("POST", "/v1/responses", body)
    assert status == 200, data[:500]
    events = [json.loads(line[len(b"data: "):]) for line in data.splitlines() if line.startswith(b"data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                               "response.incomplete"), events[-1]
    final = events[-1]["response"]
    assert final["store"] is False and final["usage"]["input_tokens"] > 500
    assert [t["type"] for t in final["tools"]].count("namespace") == 1
    assert "web_search" not in [t["type"] for t in final["tools"]]


# --- stored responses ------------------------------------------------------------------------------
@pytest.mark.model
def test_previous_response_id_continues_the_stored_conversation_from_the_cache(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", max_output_tokens=12,
                                    **GREEDY)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=12, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], 12)
    # The continuation starts with the previous prompt and answer: the prefix cache serves them
    # (all but the answer's last token, which was sampled and never computed, and what the
    # template closes the turn with).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 2, (cached, first.usage)
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=4, **GREEDY)
    items = client.responses.input_items.list(third.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 5
    assert [i.content[0].text for i in items] == ["My name is Ada. Say hello to me.", first.output_text,
                                                  "What is my name?", second.output_text, "Thanks."]
    assert items[1].id == first.output[0].id
    newest = client.responses.input_items.list(third.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["Thanks.", second.output_text] and newest.has_more


@pytest.mark.model
def test_item_references_name_stored_items(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, **GREEDY)
    (asked,) = client.responses.input_items.list(first.id).data
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                      max_output_tokens=8, **GREEDY)
    # The same conversation sent statelessly, its first two items by reference (as Codex may).
    referenced = client.responses.create(model=MODEL, max_output_tokens=8, **GREEDY, input=[
        {"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": first.output[0].id},
        {"role": "user", "content": "What is my name?"}])
    assert referenced.output_text == chained.output_text
    assert [i.id for i in client.responses.input_items.list(referenced.id, order="asc").data][:2] == \
        [asked.id, first.output[0].id]
    status, body = server.json("POST", "/v1/responses", {"model": MODEL, "input": [
        {"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_nowhere"}]})
    assert status == 400 and body["error"]["param"] == "input[1].id", body


@pytest.mark.model
def test_retrieve_and_delete(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, metadata={"task": "t1"}, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"task": "t1"}
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.model
def test_stored_responses_are_in_the_data_directory_and_expire(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    database = home / "responses" / "responses.sqlite3"
    with model_server(home, smollm2_gguf) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kept = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **GREEDY)
    with sqlite3.connect(database) as db:  # committed to the file, read by a connection of its own
        (data,) = db.execute("SELECT i.data FROM items i JOIN responses r ON r.n = i.owner "
                             "WHERE r.id=? AND i.output=1", (kept.id,)).fetchone()
    assert json.loads(data)["content"][0]["text"] == kept.output_text
    with LiveServer(server_settings(home)) as live:  # a new app on the same data directory
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert c.responses.retrieve(kept.id).output_text == kept.output_text
    with LiveServer(server_settings(home, responses_retention_days=1e-9)) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(kept.id)  # past the retention: gone, before any write pruned it
        c.responses.create(model=MODEL, input="Hi", max_output_tokens=1, **GREEDY)  # a write prunes
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT COUNT(*) FROM responses WHERE id=?", (kept.id,)).fetchone()[0] == 0


# --- errors ----------------------------------------------------------------------------------
BAD_FIELDS = [
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "x"}]}]},
     "tools[0].tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"temperature": 5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text.format"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "enormous"}}, "reasoning.effort"),
    ({"metadata": {"k": 5}}, "metadata"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"priority": "urgent"}, "priority"),
]


@pytest.mark.model
@pytest.mark.parametrize("extra,param", BAD_FIELDS, ids=[p for _, p in BAD_FIELDS])
def test_bad_fields_are_400s_naming_them(server, extra, param):
    status, body = server.json("POST", "/v1/responses", {"model": MODEL, "input": "Hi", **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body


@pytest.mark.model
def test_unknown_model_ids_and_context(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model", input="Hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):  # streamed: still the 404, before any event
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope", stream=True)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="word " * 1500)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    status, body = server.json("GET", "/v1/responses/resp_x/input_items?limit=500")
    assert status == 400 and body["error"]["param"] == "limit"
    status, body = server.json("GET", "/v1/responses/resp_x/input_items")
    assert status == 404 and body["error"]["param"] == "response_id"
    status, _, raw = server.request("POST", "/v1/responses", raw=b"{not json")
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


# --- the request path: lanes, disconnects, batches ----------------------------------------------
@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, smollm2_gguf):
    settings = server_settings(tmp_path_factory.mktemp("one-slot"), max_sequences=1)
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        yield live


def long_response(stream: bool, **extra) -> dict:
    return {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 900, "temperature": 0,
            "logit_bias": NO_EOS, "stream": stream, **extra}


@pytest.mark.model
@pytest.mark.parametrize("lane,how", [("batch", "field"), ("interactive", "header"), ("default", "none")])
def test_requests_wait_in_their_lane(one_slot, lane, how):
    holder, head = open_stream(one_slot.port, "/v1/responses", long_response(True))  # takes the only slot
    try:
        assert b" 200 " in head.split(b"\r\n")[0]
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **({"priority": lane} if how == "field" else {})}
        headers = {"X-Priority": lane, "Content-Type": "application/json"} if how == "header" else None
        answer: dict = {}
        waiter = threading.Thread(target=lambda: answer.update(r=one_slot.json("POST", "/v1/responses", body,
                                                                                headers=headers)))
        waiter.start()
        deadline = time.monotonic() + 30
        while one_slot.engine_stats()["waiting"].get(lane, 0) == 0:
            assert time.monotonic() < deadline, one_slot.engine_stats()
            time.sleep(0.02)
    finally:
        holder.close()  # the slot frees, the waiting request runs
    waiter.join(60)
    assert answer["r"][0] == 200, answer


@pytest.mark.model
def test_disconnect_mid_stream_frees_the_slot(one_slot):
    s, head = open_stream(one_slot.port, "/v1/responses", long_response(True))
    assert b" 200 " in head.split(b"\r\n")[0] and b"event: response.created" in head
    deadline = slot_deadline(one_slot)
    s.close()
    wait_idle(one_slot, deadline)


@pytest.mark.model
def test_disconnect_without_streaming_frees_the_slot(one_slot):
    assert_silent_disconnect_frees_the_slot(one_slot, "/v1/responses", long_response(False))


@pytest.mark.model
def test_batch_lines_for_v1_responses(client, tmp_path):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/responses",
              "body": {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}},
             {"custom_id": "b", "method": "POST", "url": "/v1/responses",
              "body": {"model": MODEL, "input": "Hi", "tools": [{"type": "custom", "name": "x"}]}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/responses", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 1 and batch.request_counts.failed == 1
    (out,) = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    response = out["response"]["body"]
    assert out["custom_id"] == "a" and response["object"] == "response"
    direct = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, **GREEDY)
    assert response["output"][0]["content"][0]["text"] == direct.output_text
    (err,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert err["response"]["status_code"] == 400 and err["response"]["body"]["error"]["param"] == "tools[0].type"
    assert client.responses.retrieve(response["id"]).output_text == direct.output_text  # stored, as over HTTP


# --- a hostile chat template: the render deadline holds on this route too ---------------------------
@pytest.mark.model
def test_a_runaway_template_is_a_400_within_the_render_deadline(tmp_path, smollm2_gguf):
    from test_engine_protocol import EchoEngine  # the engine without a backend

    class Hostile(EchoEngine):
        def __init__(self, name: str):
            super().__init__(name)
            self._info = dataclasses.replace(self._info, chat_template="{% for i in range(10**9) %}x{% endfor %}")

    settings = server_settings(tmp_path / "home")
    install_model(settings, smollm2_gguf)
    with LiveServer(settings, loader=lambda installed, _: Hostile(installed.ref)) as live:
        for stream in (False, True):
            t0 = time.monotonic()
            status, body = live.json("POST", "/v1/responses", {"model": MODEL, "input": "Hi", "stream": stream})
            assert time.monotonic() - t0 < RENDER_TIME_LIMIT_S + 5
            assert status == 400 and body["error"]["param"] == "input", body
            assert live.json("GET", "/health")[0] == 200


# --- the event stream without a model -------------------------------------------------------------
def _conversation(**body) -> Conversation:
    env = ApiEnv(Settings(), manager=None)  # type: ignore[arg-type]  # parse_* never touches the manager
    call = parse_responses(Body({"model": "m", "input": "Hi", **body}), env)
    return Conversation(call, call.chat, call.items)


def _streamed(conv, text: str, step: int, reason: str = "stop"):
    events = ResponseEvents(conv, "m", None)
    out = events.opening()
    for i in range(0, len(text), step):
        out += events.feed(GenerationEvent(text=text[i:i + step]))
    closing, final = events.finish(GenerationEvent(finish_reason=reason, usage=Usage(3, 5, 0)))
    return out + closing, final


@pytest.mark.parametrize("step", [1, 3, 100])
def test_thinking_streams_as_a_reasoning_item_and_matches_the_whole_answer(step):
    conv = _conversation()
    text = "<think>\nThe user greets me.</think>\n\nHello there!"
    events, final = _streamed(conv, text, step)
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "\nThe user greets me."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello there!"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    whole, _ = finished_output(conv, text, "stop", None)
    assert [{k: v for k, v in item.items() if k != "id"} for item in whole] == \
        [{k: v for k, v in item.items() if k != "id"} for item in final["output"]]


@pytest.mark.parametrize("step", [1, 4, 100])
def test_a_think_block_the_template_opened_is_reasoning_up_to_its_end(step):
    conv = _conversation()
    conv.thinking_open = True  # as prepare finds it when the prompt ends with <think>
    events, final = _streamed(conv, "Greeting.\n</think>\n\nHi!", step)
    assert [(i["type"], i["content"][0]["text"]) for i in final["output"]] == [
        ("reasoning", "Greeting.\n"), ("message", "Hi!")]
    whole, _ = finished_output(conv, "Greeting.\n</think>\n\nHi!", "stop", None)
    assert [i["content"][0]["text"] for i in whole] == ["Greeting.\n", "Hi!"]


@pytest.mark.parametrize("step", [1, 5, 100])
def test_tool_calls_stream_as_function_call_items(step):
    conv = _conversation(tools=[WEATHER_TOOL], parallel_tool_calls=False)
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    events, final = _streamed(conv, text, step)
    assert not [e for e in events if e["type"] == "response.output_text.delta"]
    (call,) = final["output"]  # parallel_tool_calls false: the first call only
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Rome"}
    whole, _ = finished_output(conv, text, "stop", None)
    assert [i["type"] for i in whole] == ["function_call"] and whole[0]["arguments"] == call["arguments"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 5


def test_an_empty_answer_is_still_one_message():
    events, final = _streamed(_conversation(), "", 1, reason="length")
    assert [item["type"] for item in final["output"]] == ["message"]
    assert final["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"


# --- the store without a model (api/response_store.py) ----------------------------------------------
def _message(item_id: str, text: str, role: str = "user") -> dict:
    return {"id": item_id, "type": "message", "role": role, "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def _answer(response_id: str, text: str) -> dict:
    return {"id": response_id, "object": "response", "output": [_message(f"out_{response_id}", text, "assistant")]}


def _texts(items: list) -> list[str]:
    return [item["content"][0]["text"] for item in (s.item if isinstance(s, StoredItem) else s for s in items)]


def _rows(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as db:
        return {table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                for table in ("responses", "items", "inputs")}


def test_deleting_a_response_keeps_only_what_live_ones_still_need(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, 30)

    async def scenario() -> None:
        await store.save(_answer("resp_a", "hello"), None, [_message("a1", "alpha")])
        await store.save(_answer("resp_b", "bye"), "resp_a", [_message("b1", "beta")])  # continues a
        referred = (await store.resolve(None, ["a1"], 1 << 20)).references["a1"]
        await store.save(_answer("resp_c", "ok"), None, [referred, _message("c1", "gamma")])  # refers to a1
        await store.delete("resp_a")
        with pytest.raises(NotFoundError):
            await store.get("resp_a")
        with pytest.raises(PreviousResponseNotFoundError):
            await store.resolve("resp_a", [], 1 << 20)
        assert (await store.resolve(None, ["a1"], 1 << 20)).references == {}  # its ids resolve no more
        # ... but the conversations that ran through it are whole, as OpenAI keeps them.
        assert _texts((await store.input_items("resp_b", False, 100, None))[0]) == ["alpha", "hello", "beta"]
        assert _texts((await store.input_items("resp_c", False, 100, None))[0]) == ["alpha", "gamma"]
        assert _texts((await store.resolve("resp_b", [], 1 << 20)).history) == ["alpha", "hello", "beta", "bye"]
        await store.delete("resp_b")
        assert _rows(path) == {"responses": 2, "items": 3, "inputs": 2}  # a's row holds a1 for c
        await store.delete("resp_c")
        assert _rows(path) == {"responses": 0, "items": 0, "inputs": 0}
        with pytest.raises(NotFoundError):
            await store.delete("resp_c")

    asyncio.run(scenario())


def test_items_belong_to_their_response_and_an_id_names_what_first_held_it(tmp_path):
    store = ResponseStore(tmp_path / "responses.sqlite3", 30)

    async def scenario() -> None:
        await store.save(_answer("resp_a", "ok"), None, [_message("shared", "The meeting is at noon.")])
        await store.save(_answer("resp_b", "ok"), None, [_message("shared", "The meeting is cancelled.")])
        assert _texts([(await store.resolve(None, ["shared"], 1 << 20)).references["shared"]]) == \
            ["The meeting is at noon."]
        assert _texts((await store.input_items("resp_a", False, 10, None))[0]) == ["The meeting is at noon."]
        assert _texts((await store.input_items("resp_b", False, 10, None))[0]) == ["The meeting is cancelled."]
        await store.delete("resp_a")  # the next holder of the id
        assert _texts([(await store.resolve(None, ["shared"], 1 << 20)).references["shared"]]) == \
            ["The meeting is cancelled."]

    asyncio.run(scenario())


def test_references_and_chains_are_bounded_by_the_body_limit(tmp_path):
    store = ResponseStore(tmp_path / "responses.sqlite3", 30)

    async def scenario() -> None:
        await store.save(_answer("resp_a", "ok"), None, [_message("big", "x" * 10_000)])
        resolved = await store.resolve(None, ["big"] * 4, 50_000)
        assert resolved.references["big"].size > 10_000
        with pytest.raises(InvalidRequestError) as e:
            await store.resolve(None, ["big"] * 5, 50_000)  # each reference counts
        assert e.value.param == "input"
        with pytest.raises(InvalidRequestError) as e:
            await store.resolve("resp_a", [], 1_000)  # the chain may hold 8 bodies: not 10 KB of 1 KB ones
        assert e.value.param == "previous_response_id"

    asyncio.run(scenario())


def test_a_schema_1_file_is_reset_and_a_newer_one_refused(tmp_path):
    old = tmp_path / "old" / "responses.sqlite3"
    old.parent.mkdir()
    with sqlite3.connect(old) as db:  # what localserve wrote before schema 2
        db.executescript("""
            PRAGMA journal_mode=WAL;
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '1');
            CREATE TABLE responses (id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL,
                                    context TEXT NOT NULL);
            CREATE TABLE items (id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL);""")
        db.execute("INSERT INTO responses VALUES ('resp_old', 1e12, '{}', ?)", (json.dumps(["OLD-SECRET" * 100]),))
    db.close()
    store = ResponseStore(old, 30)
    with pytest.raises(NotFoundError):
        asyncio.run(store.get("resp_old"))
    asyncio.run(store.save(_answer("resp_new", "ok"), None, [_message("m", "new")]))
    assert asyncio.run(store.get("resp_new"))["output"][0]["content"][0]["text"] == "ok"
    assert not any(b"OLD-SECRET" in p.read_bytes() for p in old.parent.iterdir())
    newer = tmp_path / "newer" / "responses.sqlite3"
    newer.parent.mkdir()
    with sqlite3.connect(newer) as db:
        db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                         "INSERT INTO meta VALUES ('schema_version', '3');")
    db.close()
    with pytest.raises(ConfigError):
        asyncio.run(ResponseStore(newer, 30).get("resp_x"))
