"""Reasoning you can steer (issue 45, item 3), on the real model through the real HTTP server.

The model is SmolLM2 with a think-tag chat template (tests/reasoning_model.py): its prompt opens
`<think>`, and greedy SmolLM2 never closes it, so the only end its thinking gets is the one a
budget forces. So a budget of N must give exactly N thinking tokens: the greedy answer without a
budget, cut at N tokens (`thought(N)`), then `</think>`, then the answer, and usage counts N
reasoning tokens, in every dialect, with each one's official client where the suite has it. Each
dialect gives the thinking apart from the answer where it has a place for it: OpenAI chat's
`reasoning_content` (as llama-server answers it; `reasoning_format: "none"` keeps the text as
written), the Responses API's reasoning item, Anthropic's thinking block, Ollama's `thinking`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import anthropic
import openai
import pytest

from localserve.api.think_budget import EFFORT_BUDGETS
from reasoning_model import FILE_NAME, with_think_template
from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
ASK = [{"role": "user", "content": "Write a very long essay about the history of Rome."}]  # SmolLM2 writes on and on
CLOSE = "</think>"


@pytest.fixture(scope="module")
def live(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    gguf = with_think_template(smollm2_gguf, tmp_path_factory.mktemp("think") / FILE_NAME)
    with model_server(tmp_path_factory.mktemp("home"), gguf, context_length=2048) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def thought(live):
    """thought(n): the first n tokens of the model's unbudgeted greedy thinking, as text."""
    @functools.cache
    def first(n: int) -> str:
        status, answer = live.json("POST", "/v1/chat/completions",
                                   {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": n})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == n  # it never closed it itself
        message = answer["choices"][0]["message"]
        assert message["content"] == "" and CLOSE not in message["reasoning_content"]  # all thinking
        return message["reasoning_content"]

    return first


def closed_at(text: str, thinking: str) -> str:
    """The answer after `</think>`, once `text` is checked to be `thinking` closed there."""
    assert text.startswith(thinking + CLOSE), (text[:200], thinking[:200])
    return text[len(thinking + CLOSE):]


def test_llamacpp_reasoning_budget_tokens_ends_thinking_at_n_tokens(live, thought):
    prompt_tokens = {}
    for n in (1, 12):
        status, answer = live.json("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": n + 24, "reasoning_budget_tokens": n})
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        assert message["reasoning_content"] == thought(n)
        assert message["content"].strip() and CLOSE not in message["content"]  # the answer follows the close
        usage = answer["usage"]
        assert usage["completion_tokens_details"]["reasoning_tokens"] == n
        assert usage["completion_tokens"] == n + 24
        prompt_tokens[n] = usage["prompt_tokens"]
    # 0: no thinking at all; a template that can leave it out (enable_thinking) closes the block in
    # the prompt (`\n\n</think>\n\n` more of it), and the model answers at once.
    status, answer = live.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 24, "reasoning_budget_tokens": 0})
    assert status == 200 and answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert CLOSE not in answer["choices"][0]["message"]["content"]
    assert "reasoning_content" not in answer["choices"][0]["message"]
    assert answer["usage"]["prompt_tokens"] > prompt_tokens[1]
    # -1 is llama-server's "no limit": the model thinks on to max_tokens.
    status, answer = live.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 20, "reasoning_budget_tokens": -1})
    assert status == 200 and answer["choices"][0]["message"]["reasoning_content"] == thought(20)
    # reasoning_format "none": the text as the model wrote it, the forced tag inside.
    status, answer = live.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 24, "reasoning_budget_tokens": 12,
        "reasoning_format": "none"})
    assert status == 200 and closed_at(answer["choices"][0]["message"]["content"], thought(12)).strip()
    assert "reasoning_content" not in answer["choices"][0]["message"]


def test_openai_sdk_reasoning_effort_streamed_and_whole(oai, thought):
    n = EFFORT_BUDGETS["minimal"]
    whole = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=n + 16,
                                        reasoning_effort="minimal")
    assert whole.choices[0].message.model_extra["reasoning_content"] == thought(n)
    assert whole.choices[0].message.content.strip() and CLOSE not in whole.choices[0].message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens == n
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=n + 16,
                                              reasoning_effort="minimal", stream=True,
                                              stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought(n)
    # the thinking streams as it comes: many pieces, every one before the answer's first
    kinds = ["thinking" if (d.model_extra or {}).get("reasoning_content") else "answer" for d in deltas if
             d.content or (d.model_extra or {}).get("reasoning_content")]
    assert kinds.count("thinking") > 3 and "thinking" not in kinds[kinds.index("answer"):]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == n


def test_a_stop_string_and_a_budget_together(live, thought):
    """The forced end tag is text like any other: a stop string finds it."""
    status, answer = live.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 40, "reasoning_budget_tokens": 10,
        "stop": ["think>"]})
    assert status == 200, answer
    choice = answer["choices"][0]
    # the stop cut the tag: what was held back as its possible start ends the thinking
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"] == thought(10) + "</"
    assert choice["message"]["content"] == ""


def test_responses_reasoning_effort_is_a_reasoning_item_of_n_tokens(oai, thought):
    n = EFFORT_BUDGETS["minimal"]
    r = oai.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0, max_output_tokens=n + 16,
                             reasoning={"effort": "minimal"}, store=False)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought(n)
    assert message.type == "message" and message.content[0].text.strip()
    assert r.usage.output_tokens_details.reasoning_tokens == n
    assert r.reasoning.effort == "minimal"


def test_anthropic_sdk_thinking_budget_tokens(live, thought):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=300)
    n = 16
    m = client.messages.create(model=MODEL, max_tokens=n + 24, extra_body={"temperature": 0}, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": n})
    thinking, text = m.content
    assert thinking.type == "thinking" and thinking.thinking == thought(n)
    assert text.type == "text" and text.text.strip()
    assert m.usage.output_tokens == n + 24  # Anthropic counts thinking in output_tokens; it has no field of its own
    # Streamed: the same blocks.
    with client.messages.stream(model=MODEL, max_tokens=n + 24, extra_body={"temperature": 0}, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": n}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    # Claude Code's shape: adaptive thinking with an effort, which is the level's budget.
    n = EFFORT_BUDGETS["low"]
    m = client.messages.create(model=MODEL, max_tokens=n + 16, messages=ASK, thinking={"type": "adaptive"},
                               extra_body={"temperature": 0, "output_config": {"effort": "low"}})
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == thought(n)


def test_ollama_client_think_levels(live, thought):
    """`think` set: the thought comes apart in `thinking`, as Ollama answers it."""
    import ollama

    client = ollama.Client(host=live.url)
    n = EFFORT_BUDGETS["low"]
    r = client.chat(model=MODEL, messages=ASK, think="low", options={"temperature": 0, "num_predict": n + 16})
    assert r.message.thinking == thought(n) and r.message.content.strip() and CLOSE not in r.message.content
    assert r.eval_count == n + 16
    # true: thinking apart, no budget; false closes the block in the prompt (the template's
    # enable_thinking): no thinking at all, and a longer prompt.
    on = client.chat(model=MODEL, messages=ASK, think=True, options={"temperature": 0, "num_predict": 12})
    off = client.chat(model=MODEL, messages=ASK, think=False, options={"temperature": 0, "num_predict": 12})
    assert on.message.thinking == thought(12) and on.message.content == ""
    streamed = list(client.chat(model=MODEL, messages=ASK, think=True, stream=True,
                                options={"temperature": 0, "num_predict": 12}))
    assert "".join(c.message.thinking or "" for c in streamed) == on.message.thinking
    assert off.prompt_eval_count > on.prompt_eval_count and not off.message.thinking
    gen = client.generate(model=MODEL, prompt=ASK[0]["content"], think=True, options={"temperature": 0, "num_predict": 12})
    assert gen.thinking == thought(12) and gen.response == ""
    # Without `think` the text is the model's as written, the forced tag included.
    status, raw = live.json("POST", "/api/chat", {"model": MODEL, "messages": ASK, "stream": False,
                                                  "options": {"temperature": 0, "num_predict": 12}})
    assert status == 200 and raw["message"]["content"] == thought(12) and "thinking" not in raw["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"reasoning_effort": "enormous"}, "reasoning_effort"),
    ("/v1/chat/completions", {"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ("/v1/chat/completions", {"reasoning_budget": "lots"}, "reasoning_budget"),
    ("/v1/chat/completions", {"reasoning_format": "verbose"}, "reasoning_format"),
    ("/v1/responses", {"reasoning": {"effort": "enormous"}}, "reasoning.effort"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
])
def test_bad_budgets_are_400s_in_the_dialects_shape(live, path, body, param):
    base = {"model": MODEL, "max_tokens": 8}
    base.update({"input": "hi"} if path == "/v1/responses" else {"messages": ASK})
    status, answer = live.json("POST", path, {**base, **body})
    assert status == 400, answer
    error = answer["error"]
    if path == "/v1/messages":
        assert answer["type"] == "error" and error["type"] == "invalid_request_error" and param in error["message"]
    else:
        assert error["param"] == param and error["type"] == "invalid_request_error"


def test_ollama_bad_think_is_a_400_in_ollamas_shape(live):
    for path, body in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "hi"})):
        status, answer = live.json("POST", path, {"model": MODEL, "think": "extreme", "stream": False, **body})
        assert status == 400 and set(answer) == {"error"} and "'think'" in answer["error"], answer
    status, answer = live.json("POST", "/api/chat", {"model": MODEL, "think": 3, "messages": ASK, "stream": False})
    assert status == 400 and "'think'" in json.dumps(answer)


def test_a_budget_holds_while_speculative_decoding_drafts(smollm2_gguf, tmp_path):
    """Drafts verified across the budget: the close still comes after exactly N thinking tokens,
    once, and the KV the forced tag replaced is not kept (the answer goes on coherently to
    max_tokens, and the same server's drafted answer without a budget agrees up to the close)."""
    from test_speculation import ROOT, SOURCES, draft_counts

    source = "".join((ROOT / SOURCES[0]).read_text().splitlines(True)[:24])
    copy = [{"role": "user", "content": "Return this Python file unchanged:\n\n" + source}]
    gguf = with_think_template(smollm2_gguf, tmp_path / FILE_NAME)
    with model_server(tmp_path / "home", gguf, speculative="ngram", context_length=2048) as server:
        for n in (40, 97):
            status, answer = server.json("POST", "/v1/chat/completions", {
                "model": MODEL, "messages": copy, "temperature": 0, "max_tokens": n + 40, "reasoning_budget_tokens": n,
                "reasoning_format": "none"})  # the text as written: the tag where the budget put it
            assert status == 200, answer
            text = answer["choices"][0]["message"]["content"]
            assert text.count(CLOSE) == 1 and answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == n
            assert answer["usage"]["completion_tokens"] == n + 40
            # Against the drafted answer without a budget: drafting alone may part from plain decoding at
            # a near-tie (test_speculation.py), and at 97 tokens on this prompt it does.
            status, free = server.json("POST", "/v1/chat/completions", {
                "model": MODEL, "messages": copy, "temperature": 0, "max_tokens": n, "reasoning_format": "none"})
            assert status == 200 and text.startswith(free["choices"][0]["message"]["content"] + CLOSE)
        drafted, accepted = draft_counts(server)
        assert drafted >= accepted > 0
