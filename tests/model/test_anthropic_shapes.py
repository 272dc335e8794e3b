"""Anthropic's shapes where SmolLM2 cannot show them: a reasoning model's thinking blocks (an echo
engine behind the real app and manager, whose template is a reasoning one and whose answer is the
prompt, one byte per event, so every tag arrives split), Claude Code's request normalised for the
prefix cache, and the error statuses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anthropic
import pytest

from localserve.api.anthropic_messages import chat_messages, chat_tool_choice, chat_tools
from localserve.api.errors import anthropic_error
from localserve.api.validation import Body
from localserve.errors import InvalidRequestError
from server_harness import MODEL, LiveServer, install_model, server_settings
from test_engine_protocol import EchoEngine

# Mentions enable_thinking, as Qwen3's does: a template of a model that reasons.
THINKING_TEMPLATE = "{% if enable_thinking is defined and not enable_thinking %}{% endif %}{{ messages[-1]['content'] }}"
ANSWER = "<think>The user wants a colour.\nRed is one.</think>\n\nRed."


class ThinkingLoader:
    def __call__(self, installed, settings) -> EchoEngine:
        engine = EchoEngine(installed.ref)
        engine._info = dataclasses.replace(engine._info, chat_template=THINKING_TEMPLATE)
        return engine


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_gguf: Path):
    settings = server_settings(tmp_path_factory.mktemp("thinking-home"))
    install_model(settings, smollm2_gguf)
    with LiveServer(settings, loader=ThinkingLoader()) as live:
        yield anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)


def ask(**extra):
    return dict(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": ANSWER}], **extra)


def test_thinking_blocks_when_asked(client):
    m = client.messages.create(**ask(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "The user wants a colour.\nRed is one."), ("text", "Red.")]
    with client.messages.stream(**ask(thinking={"type": "adaptive"})) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert [b.model_dump(exclude_none=True) for b in final.content] == [b.model_dump(exclude_none=True) for b in m.content]


def test_no_thinking_blocks_unless_asked(client):
    for extra in ({}, {"thinking": {"type": "disabled"}}, {"thinking": {"type": "enabled", "budget_tokens": 2000,
                                                                         "display": "omitted"}}):
        m = client.messages.create(**ask(**extra))
        assert [(b.type, b.text) for b in m.content] == [("text", "Red.")], extra


def test_bad_thinking_is_a_400(client):
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        client.messages.create(**ask(thinking={"type": "sometimes"}))


# --- Claude Code's request, normalised -----------------------------------------------------------
def test_billing_header_dropped_and_reminders_kept_in_place():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.3a3; cc_entrypoint=cli; cch=abc12;"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "a.py"}]}]},
        {"role": "system", "content": "<total_tokens>100 tokens left</total_tokens>"},
        {"role": "user", "content": [{"type": "text", "text": "x-anthropic-billing-header: kept in a user turn"}]},
    ]
    out = chat_messages(system, messages)
    assert out[0] == {"role": "system", "content": "You are Claude Code."}
    assert out[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}]}
    # The reminder stays after the tool result it follows, never hoisted into the system prompt.
    assert out[3] == {"role": "tool", "tool_call_id": "t1", "name": "Bash",
                      "content": "a.py\n\n<total_tokens>100 tokens left</total_tokens>"}
    assert out[4]["content"] == "x-anthropic-billing-header: kept in a user turn"
    # The same request with another cch renders the same messages.
    system[0]["text"] = system[0]["text"].replace("abc12", "fe9d0")
    assert chat_messages(system, messages) == out
    assert chat_messages("x-anthropic-billing-header: cch=1;\nHello.", [{"role": "user", "content": "hi"}])[0] == \
        {"role": "system", "content": "Hello."}


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}], "messages[0].content[0].content[0].source.type"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}],
     "messages[0].content[0].input"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([], "messages"),
])
def test_bad_blocks_name_their_field(messages, param):
    with pytest.raises(InvalidRequestError) as e:
        chat_messages(None, messages)
    assert e.value.param == param


def test_tools_and_tool_choice():
    assert chat_tools([{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(InvalidRequestError) as e:
        chat_tools([{"type": "web_search_20250305", "name": "web_search"}])
    assert e.value.param == "tools[0].type"
    choices = [chat_tool_choice(Body({"tool_choice": {"type": kind, "name": "f"}})) for kind in ("auto", "any", "none", "tool")]
    assert choices == ["auto", "required", "none", {"type": "function", "function": {"name": "f"}}]


def test_error_statuses_are_anthropics():
    assert anthropic_error(503, "busy") == (529, {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    assert [anthropic_error(s, "m")[1]["error"]["type"] for s in (400, 401, 403, 404, 413, 429, 500)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "request_too_large",
        "rate_limit_error", "api_error"]
    assert anthropic_error(408, "slow")[0:1] == (408,) and anthropic_error(408, "slow")[1]["error"]["type"] == "timeout_error"


def test_model_aliases_setting(tmp_path):
    from localserve.config.aliases import alias_target
    from localserve.config.settings import load_settings
    from localserve.errors import ConfigError

    config = tmp_path / "config.toml"
    config.write_text('model_aliases = ["claude-3-*=old", "claude-*=smollm2-135m"]\n')
    settings = load_settings(environ={}, config_path=config)
    assert [alias_target(n, settings.model_aliases) for n in ("claude-3-haiku", "Claude-Opus-4", "gpt-4o")] == \
        ["old", "smollm2-135m", None]  # the first match wins, case aside
    env = load_settings(environ={"LOCALSERVE_MODEL_ALIASES": "gpt-*=a, o?-mini=b"}, config_path=tmp_path / "none")
    assert env.model_aliases == ("gpt-*=a", "o?-mini=b") and alias_target("o4-mini", env.model_aliases) == "b"
    with pytest.raises(ConfigError, match="model_aliases"):
        load_settings(environ={"LOCALSERVE_MODEL_ALIASES": "claude-*"}, config_path=tmp_path / "none")
