"""The OpenAI-compatible API, end to end: the real model behind create_app on a real local server,
driven by the official `openai` package, once on each backend (llama.cpp, and ONNX Runtime on the
converted model: server_harness.BACKENDS)."""

from __future__ import annotations

import json

import openai
import pytest

from server_harness import BACKENDS, MODEL, MODEL_TAG, backend_server

pytestmark = pytest.mark.model
GREEDY = {"temperature": 0.0}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=BACKENDS)
def server(request):
    with backend_server(request, max_body_bytes=256 * 1024) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    assert r.object == "chat.completion"
    assert r.model == f"{MODEL}:{MODEL_TAG}"
    assert r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    # include_usage: one last chunk without choices carries the usage; the others carry none.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # The repeated prompt was served from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_streaming_and_not(client):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    assert whole.object == "text_completion"
    assert whole.choices[0].text
    parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True, **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completions_several_prompts_token_ids_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: the n choices of one prompt agree
    by_text = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, **GREEDY)
    assert by_text.choices[0].text == r.choices[0].text
    tokens = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=1, logprobs=1, **GREEDY)
    assert tokens.choices[0].logprobs.tokens
    echoed = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "One, two," + by_text.choices[0].text


def test_seeds_are_reproducible(client):
    def sample(seed):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a short poem."}],
                                           max_tokens=24, temperature=1.0, seed=seed)
        return r.choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_n_choices_with_seed_differ_but_repeat(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name an animal."}], max_tokens=12,
              temperature=1.0, n=3, seed=7)
    first = [c.message.content for c in client.chat.completions.create(**kw).choices]
    second = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert first == second and len(first) == 3


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the largest city of Japan as JSON."}],
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        **GREEDY)
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"city", "population"}
    assert isinstance(data["city"], str) and isinstance(data["population"], int)

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
                                       max_tokens=40, response_format={"type": "json_object"}, **GREEDY)
    assert r.choices[0].message.content.lstrip().startswith("{")


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.token == item.top_logprobs[0].token  # greedy picks the most likely token
        assert item.bytes == list(item.token.encode())
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_stop_sequence(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, stop=[" 7"], **GREEDY)
    assert " 7" not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_clamped_to_context_left(client):
    # ~1000 prompt tokens in a 1024-token context: a huge max_tokens is cut to what is left.
    prompt = "word " * 1000
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10**9, **GREEDY)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 1024
    assert r.choices[0].finish_reason in ("length", "stop")


def test_forced_tool_call(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                       "required": ["city"]}}}]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, **GREEDY)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_embeddings(client):
    one = client.embeddings.create(model=MODEL, input="hello world")  # the package asks for base64
    (item,) = one.data
    assert len(item.embedding) == 576
    assert abs(sum(x * x for x in item.embedding) - 1.0) < 1e-3  # L2-normalised
    assert one.usage.prompt_tokens > 0
    many = client.embeddings.create(model=MODEL, input=["hello world", "goodbye"], encoding_format="float")
    assert [d.index for d in many.data] == [0, 1]
    assert many.data[0].embedding == pytest.approx(item.embedding, abs=1e-5)
    # Token ids are refused unless the setting embed_token_ids says they are this model's
    # (tests/model/test_ui_clients.py replays langchain-openai's cl100k ids).
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[[28120, 905]], encoding_format="float")
    assert refused.value.body["param"] == "input" and "embed_token_ids" in refused.value.body["message"]


def test_models(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [f"{MODEL}:{MODEL_TAG}"]
    assert client.models.retrieve(MODEL).id == f"{MODEL}:{MODEL_TAG}"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_priority_lane_field_and_header(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"priority": "batch"},
                                       **GREEDY)
    assert r.choices
    status, body = server.json("POST", "/v1/chat/completions",
                               {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                               headers={"X-Priority": "urgent", "Content-Type": "application/json"})
    assert status == 400 and body["error"]["param"] == "X-Priority"
