"""Anthropic's Messages API end to end: the official `anthropic` SDK against the real server and
SmolLM2 (create, messages.stream, a tool_result round trip, count_tokens, models, an error of each
kind), greedy answers equal to /v1/chat/completions for the same conversation, lanes, disconnects,
the Batch API, and a replayed three-turn Claude Code conversation whose turns reuse the prefix
cache although its billing header changes every turn."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import openai
import pytest

from server_harness import MODEL, MODEL_TAG, LiveServer, install_model, model_server, server_settings
from test_batches import contents, line, submit, wait
from test_server_load import (assert_silent_disconnect_frees_the_slot, long_completion, open_stream, slot_deadline,
                              wait_idle)

pytestmark = pytest.mark.model
SERVED = f"{MODEL}:{MODEL_TAG}"
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK version has no temperature argument
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
TOOLS = [{"name": "get_weather", "description": "Get the current weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("anthropic"), smollm2_gguf, context_length=4096,
                      max_body_bytes=256 * 1024, model_aliases=("claude-*=smollm2-135m",)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def sse_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in data.decode().split("\n\n"):
        if not frame.strip():
            continue
        fields = dict(line.split(": ", 1) for line in frame.split("\n"))
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_create(client):
    m = client.messages.create(model="claude-sonnet-4-5", max_tokens=24, system=SYSTEM,
                               messages=[{"role": "user", "content": QUESTION}], **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == SERVED  # the claude-* name was served by the model model_aliases maps it to
    (block,) = m.content
    assert block.type == "text" and block.text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10
    assert 0 < m.usage.output_tokens <= 24 and m.usage.cache_creation_input_tokens == 0


def test_greedy_answers_equal_chat_completions(client, oai):
    m = client.messages.create(model=MODEL, max_tokens=32, system=[{"type": "text", "text": SYSTEM}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}], **GREEDY)
    c = oai.chat.completions.create(model=MODEL, max_tokens=32, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert m.content[0].text == c.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]


def test_stream_matches_create(client):
    kwargs = dict(model=MODEL, max_tokens=32, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], **GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # The repeated prompt came from the prefix cache.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds


def test_raw_event_sequence_with_beta_query(live):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    status, headers, data = live.request("POST", "/v1/messages?beta=true", body,
                                         headers={"anthropic-version": "2023-06-01", "Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(data)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)  # every event names its data's type
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas) and "".join(d["text"] for d in deltas)
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == "max_tokens" and end["usage"]["output_tokens"] == 8


def test_stop_sequences(client):
    whole = client.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": QUESTION}],
                                   **GREEDY)
    word = whole.content[0].text.split()[2]
    m = client.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": QUESTION}],
                               stop_sequences=[word], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text and whole.content[0].text.startswith(m.content[0].text)


def test_last_assistant_turn_is_continued(client):
    ask = [{"role": "user", "content": QUESTION}]
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ask, **GREEDY).content[0].text
    prefill = " ".join(whole.split()[:3])
    m = client.messages.create(model=MODEL, max_tokens=24, **GREEDY,
                               messages=ask + [{"role": "assistant", "content": prefill}])
    assert (prefill + m.content[0].text).startswith(whole), (whole, prefill, m.content[0].text)
    assert not m.content[0].text.startswith(prefill)


def test_tool_use_and_tool_result_round_trip(client, oai):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=48, tools=TOOLS, messages=ask,
                               tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and use.id.startswith("toolu_")
    # The same call streamed: one tool_use block whose input arrives as input_json_delta.
    with client.messages.stream(model=MODEL, max_tokens=48, tools=TOOLS, messages=ask,
                                tool_choice={"type": "any"}, **GREEDY) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    # The result goes back; the answer equals the chat path's for the same conversation.
    result = "Sunny, 24 degrees Celsius."
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    answer = client.messages.create(model=MODEL, max_tokens=32, tools=TOOLS, messages=history, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    chat = oai.chat.completions.create(model=MODEL, max_tokens=32, temperature=0, tools=OPENAI_TOOLS, messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}])
    assert answer.content[0].text == chat.choices[0].message.content


def test_count_tokens_is_the_prompt_create_gets(client):
    kwargs = dict(model="claude-haiku-4-5", system=SYSTEM, tools=TOOLS,
                  messages=[{"role": "user", "content": QUESTION}])
    counted = client.messages.count_tokens(**kwargs).input_tokens
    m = client.messages.create(max_tokens=2, **kwargs, **GREEDY)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    # The tools are part of it.
    assert client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=kwargs["messages"]).input_tokens < counted


def test_models_in_anthropic_shape(client, oai):
    page = client.models.list()
    assert [m.id for m in page.data] == [SERVED] and page.data[0].type == "model" and not page.has_more
    assert client.models.retrieve(MODEL).id == SERVED
    assert [m.id for m in oai.models.list().data] == [SERVED]  # without anthropic-version: OpenAI's shape


def test_errors_in_anthropic_shape(client, live):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="gpt-4o", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "model_aliases" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert e.value.body["error"] == {"type": "invalid_request_error", "message": e.value.body["error"]["message"]}
    assert "messages[0].content[0].source.data" in e.value.body["error"]["message"]  # a PNG signature alone
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": 1.5})  # Anthropic's range is 0..1
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x" * 300_000}])
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"
    status, body = live.json("POST", "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body == {"type": "error", "error": {"type": "invalid_request_error",
                                                                  "message": "'max_tokens' is required"}}
    status, body = live.json("POST", "/v1/messages/nope", {})
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_api_key_by_x_api_key_or_bearer(smollm2_gguf, tmp_path):
    settings = server_settings(tmp_path / "home", api_key="sekrit")
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as keyed:
        ask = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(**ask)
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
        assert anthropic.Anthropic(base_url=keyed.url, api_key="sekrit", max_retries=0).messages.create(**ask).content
        # Claude Code's ANTHROPIC_AUTH_TOKEN: a Bearer token.
        bearer = anthropic.Anthropic(base_url=keyed.url, auth_token="sekrit", max_retries=0)
        assert bearer.messages.count_tokens(model=MODEL, messages=ask["messages"]).input_tokens > 0


def test_aliases_serve_every_dialect_but_never_shadow_a_model(live, oai):
    # The Ollama and OpenAI routes take the alias too: it resolves where every name resolves.
    status, body = live.json("POST", "/api/chat", {"model": "claude-opus-4-1", "stream": False, "options": {
        "num_predict": 2}, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["model"] == SERVED
    c = oai.chat.completions.create(model="CLAUDE-3-haiku", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert c.model == SERVED  # glob patterns match without regard to case
    with pytest.raises(openai.NotFoundError, match="model_aliases"):
        oai.chat.completions.create(model="llama-9", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


# --- Claude Code's prompt cache across turns -----------------------------------------------------
CLAUDE_CODE_SYSTEM = " ".join(
    f"Rule {i}: when working in the repository, read the file before editing it, keep changes small, run the "
    f"tests that cover the change, and explain what you did in one short paragraph." for i in range(24))
CLAUDE_CODE_TOOLS = [
    {"name": "Bash", "description": "Run a shell command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "Read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
]


def claude_code_turn(cch: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A request as Claude Code sends it: the billing header block (its cch changes every request)
    first in `system`, cache_control breakpoints, tools, and the conversation so far."""
    return {"model": "claude-sonnet-4-5-20250929", "max_tokens": 16, "temperature": 0, "metadata": {"user_id": "u1"},
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.{cch[:3]}; "
                                                 f"cc_entrypoint=cli; cch={cch};"},
                       {"type": "text", "text": CLAUDE_CODE_SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "tools": CLAUDE_CODE_TOOLS, "messages": messages}


def test_claude_code_turns_reuse_the_prefix_cache(live):
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219",
               "Content-Type": "application/json"}

    def send(body: dict[str, Any]) -> dict[str, Any]:
        status, answer = live.json("POST", "/v1/messages?beta=true", body, headers=headers)
        assert status == 200, answer
        return answer["usage"]

    first = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>The working directory is /repo.</system-reminder>"},
        {"type": "text", "text": "List the files in the repository.", "cache_control": {"type": "ephemeral"}}]}]
    u1 = send(claude_code_turn("3f9a1", first))
    second = first + [
        {"role": "assistant", "content": [{"type": "text", "text": "I will list them."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "Bash",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": "README.md\nsetup.py\nsrc"}]},
        {"role": "system", "content": "<total_tokens>181234 tokens left</total_tokens>"}]  # after each tool result
    u2 = send(claude_code_turn("b07c2", second))
    third = second + [
        {"role": "assistant", "content": [{"type": "text", "text": "There are three entries."}]},
        {"role": "user", "content": [{"type": "text", "text": "Read README.md."}]}]
    u3 = send(claude_code_turn("e41d8", third))
    for before, after in ((u1, u2), (u2, u3)):
        previous_prompt = before["input_tokens"] + before["cache_read_input_tokens"]
        assert after["cache_read_input_tokens"] > 0.9 * previous_prompt, (before, after)
    assert u1["input_tokens"] + u1["cache_read_input_tokens"] > 400  # a prompt worth caching


# --- lanes, disconnects, batches -----------------------------------------------------------------
def long_message(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 900, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write the longest story you can about a lighthouse."}], **extra}


def test_lanes_and_a_full_lane(smollm2_gguf, tmp_path):
    # Keepalives every 0.2 s: a queued stream's 200 waits for its first one (server/held.py).
    settings = server_settings(tmp_path / "home", max_sequences=1, queue_size=1, sse_ping_interval=0.2)
    install_model(settings, smollm2_gguf)
    with LiveServer(settings) as live:
        # The only sequence, on the best lane: nothing that arrives preempts it.
        running, head = open_stream(live.port, "/v1/completions", {**long_completion(True), "priority": "interactive"})
        assert b"data:" in head
        streamed, head = open_stream(live.port, "/v1/messages", long_message(max_tokens=4), wait_data=False)
        queued, head2 = open_stream(live.port, "/v1/messages", long_message(max_tokens=4, priority="batch"),
                                    wait_data=False)
        try:
            assert b" 200 " in head.split(b"\r\n")[0] and b" 200 " in head2.split(b"\r\n")[0]
            waiting = live.engine_stats()["waiting"]
            # A streamed message is interactive (someone watches it); `priority` names another lane.
            assert waiting["interactive"] == 1 and waiting["batch"] == 1, waiting
            status, headers, data = live.request("POST", "/v1/messages", long_message(max_tokens=4))
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert json.loads(data)["error"]["type"] == "rate_limit_error"
        finally:
            for s in (running, streamed, queued):
                s.close()
        wait_idle(live, 10.0)


def test_disconnect_cancels_the_message(live):
    s, head = open_stream(live.port, "/v1/messages", long_message())
    assert b" 200 " in head.split(b"\r\n")[0] and b"event: message_start" in head
    time.sleep(0.3)
    assert live.engine_stats()["running"] == 1  # still generating: the model did not stop by itself
    deadline = slot_deadline(live)
    s.close()
    wait_idle(live, deadline)


def test_disconnect_without_streaming_cancels_the_message(live):
    assert_silent_disconnect_frees_the_slot(live, "/v1/messages", long_message(stream=False))


def test_batch_of_messages_answers_as_single_requests(live, client, oai):
    bodies = {f"m{i}": {"model": "claude-haiku-4-5", "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"Name fruit number {i}."}]} for i in range(3)}
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]}
    lines = [line(cid, "/v1/messages", {**b, "temperature": 0}) for cid, b in bodies.items()]
    lines.append(line("bad", "/v1/messages", bad))
    done = wait(oai, submit(oai, lines, "/v1/messages").id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    out = {item["custom_id"]: item for item in contents(oai, done.output_file_id)}
    for cid, body in bodies.items():
        got = out[cid]["response"]["body"]
        assert got["type"] == "message"
        alone = client.messages.create(**body, **GREEDY)
        assert got["content"] == [b.model_dump(exclude_none=True) for b in alone.content]
    (error,) = contents(oai, done.error_file_id)
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["type"] == "invalid_request_error"

