"""The shared OpenAI request path (server/openai_api.py) driven directly, with no HTTP request, on
the real model: the same body gives the same answer as the HTTP route, so a batch runner that feeds
JSONL lines through these functions answers exactly as /v1 does."""

from __future__ import annotations

import pytest

from localserve.errors import InvalidRequestError
from localserve.api.openai import (
    ApiEnv,
    chat_completion,
    completion,
    parse_chat,
    parse_completion,
)
from localserve.api.openai_embeddings import embeddings, parse_embeddings
from localserve.api.validation import Body
from server_harness import MODEL, MODEL_TAG, model_server

pytestmark = pytest.mark.model
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 16, "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2}


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf) as live:
        yield live


def direct(server, run, parse, body: dict) -> dict:
    """Run one shared endpoint function on the server's own loop and manager, without HTTP."""
    async def go() -> dict:
        env = ApiEnv(server.settings, server.manager)
        return await run(parse(Body(body), env), env)

    return server.call(go())


def without_ids(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_chat_completion_without_http_matches_the_route(server):
    status, over_http = server.json("POST", "/v1/chat/completions", CHAT)
    assert status == 200, over_http
    answer = direct(server, chat_completion, parse_chat, CHAT)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["model"] == f"{MODEL}:{MODEL_TAG}"
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["choices"][0]["logprobs"]["content"]  # the options reach the engine, not just the text
    # Same text, finish reasons, logprobs and token counts; the cached-token count may differ, since
    # the second run finds the first one's prompt in the prefix cache.
    for a in (answer, over_http):
        a["usage"]["prompt_tokens_details"] = None
    assert without_ids(answer) == without_ids(over_http)


def test_completion_and_embeddings_without_http_match_the_routes(server):
    body = {"model": MODEL, "prompt": ["The sky is", "Grass is"], "max_tokens": 6, "temperature": 0, "echo": True}
    status, over_http = server.json("POST", "/v1/completions", body)
    assert status == 200
    answer = direct(server, completion, parse_completion, body)
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in over_http["choices"]]
    assert answer["choices"][0]["text"].startswith("The sky is")

    body = {"model": MODEL, "input": ["red", "blue"]}
    status, over_http = server.json("POST", "/v1/embeddings", body)
    assert status == 200
    assert direct(server, embeddings, parse_embeddings, body) == over_http
    # A batch line's body carries priority "batch" (its embedding must not stop the batch's own
    # steps): the lane changes nothing in the answer, and a lane that does not exist is a 400.
    assert direct(server, embeddings, parse_embeddings, {**body, "priority": "batch"}) == over_http
    status, refused = server.json("POST", "/v1/embeddings", {**body, "priority": "urgent"})
    assert status == 400 and refused["error"]["param"] == "priority"


def test_refusals_without_http_are_the_same_errors(server):
    with pytest.raises(InvalidRequestError) as e:
        direct(server, chat_completion, parse_chat, {**CHAT, "top_p": 0})
    assert e.value.param == "top_p"
    status, over_http = server.json("POST", "/v1/chat/completions", {**CHAT, "top_p": 0})
    assert status == 400 and over_http["error"]["message"] == e.value.message
