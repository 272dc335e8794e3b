"""What chat UIs and client libraries send, replayed against the real server and model (issue 47,
items 5-7): the Ollama dialect as Open WebUI, llm-ollama and ollama-ai-provider-v2 use it (trimming,
copy, create, capabilities, top-level options), Open WebUI's 36 built-in tools on a template without
tool support, and langchain-openai's token-id embeddings. Each is driven with the client's own
package where it installs here (ollama, openai), else with the body the client sends."""

from __future__ import annotations

import math
from pathlib import Path

import openai
import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
# "hello world" in OpenAI's cl100k tokenizer, as langchain-openai's OpenAIEmbeddings sends it by
# default (check_embedding_ctx_length=True tokenizes with tiktoken and posts the ids).
CL100K_HELLO_WORLD = [15339, 1917]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, context_length=2048) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# --- item 7: token-id embeddings ------------------------------------------------------------------
def test_langchain_cl100k_ids_are_refused_by_name(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[CL100K_HELLO_WORLD])  # base64, as the SDK asks
    body = refused.value.body
    assert body["param"] == "input" and "embed_token_ids" in body["message"]
    assert "check_embedding_ctx_length=False" in body["message"]  # the client-side way out
    # Text is embedded as ever.
    assert len(client.embeddings.create(model=MODEL, input=["hello world"]).data[0].embedding) == 576


def test_the_setting_takes_ids_as_this_models_own(tmp_path: Path, smollm2_gguf: Path) -> None:
    with model_server(tmp_path, smollm2_gguf, embed_token_ids=True) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        text = client.embeddings.create(model=MODEL, input="hello world").data[0].embedding
        own_ids = live.call(_tokenize(live, "hello world"))
        ids = client.embeddings.create(model=MODEL, input=[own_ids]).data[0].embedding
    cosine = sum(a * b for a, b in zip(text, ids)) / math.sqrt(sum(a * a for a in text) * sum(b * b for b in ids))
    assert cosine > 0.999  # the same text, as ids of this model's own tokenizer


async def _tokenize(live, text: str) -> list[int]:
    async with live.manager.use(MODEL) as loaded:
        return list(loaded.engine.tokenize(text, add_special=True))


# --- item 5: Ollama's dialect as UIs and libraries use it ----------------------------------------
@pytest.fixture(scope="module")
def ollama_client(server):
    import ollama

    return ollama.Client(host=server.url, timeout=120)


def test_a_chat_longer_than_the_context_is_answered_with_its_oldest_turns_cut(server, ollama_client) -> None:
    """Open WebUI sends the whole conversation every turn and leaves the fitting to the server."""
    turns = []
    for i in range(12):  # ~900 tokens of history in the 512 tokens of context the request asks for
        turns += [{"role": "user", "content": f"Question {i}: tell me about the number {i} in a few words. " * 3},
                  {"role": "assistant", "content": f"The number {i} is a number that comes after {i - 1}. " * 3}]
    messages = [{"role": "system", "content": "You are a terse assistant."}, *turns,
                {"role": "user", "content": "What is the capital of France?"}]
    options = {"temperature": 0, "num_predict": 8, "num_ctx": 512}
    answer = ollama_client.chat(model=MODEL, messages=messages, options=options)
    assert answer.done and answer.message.content
    # prompt_eval_count is the prompt that was read: within the context, with room left for the answer.
    assert 256 < answer.prompt_eval_count <= 512 - 8 and answer.eval_count <= 8
    status, raw = server.json("POST", "/api/chat", {"model": MODEL, "messages": messages, "stream": False,
                                                    "options": options})
    assert status == 200 and raw["messages_dropped"] > 0 and "left out" in raw["warning"]
    assert raw["context_left"] == 512 - raw["prompt_eval_count"] - raw["eval_count"]
    # The latest message alone over the context is still the 400 it was.
    status, refused = server.json("POST", "/api/chat", {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "word " * 4000}]})
    assert status == 400 and "2048" in refused["error"]


def test_show_lists_tools_for_a_model_served_through_the_fallback(ollama_client) -> None:
    """llm-ollama refuses tools unless /api/show lists them; SmolLM2's template has none of its own."""
    assert "tools" in ollama_client.show(MODEL).capabilities


PROVIDER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city", "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}}]


def test_ollama_ai_provider_v2_top_level_settings_are_honoured(server) -> None:
    """The Vercel AI SDK's Ollama provider: temperature, top_p and max_output_tokens at the top."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "temperature": 0, "top_p": 1, "max_output_tokens": 5, "think": False, "stream": False}
    status, first = server.json("POST", "/api/chat", body)
    assert status == 200, first
    assert first["eval_count"] == 5 and first["done_reason"] == "length"
    _, again = server.json("POST", "/api/chat", {**body, "options": {"seed": 7}})
    assert again["message"]["content"] == first["message"]["content"]  # greedy: the same text whatever the seed
    # An explicit option wins over the top-level setting.
    _, longer = server.json("POST", "/api/chat", {**body, "options": {"num_predict": 7}})
    assert longer["eval_count"] == 7
    status, refused = server.json("POST", "/api/chat", {**body, "temperature": 9})
    assert status == 400 and "'temperature'" in refused["error"]


def test_ollama_ai_provider_v2_tool_choice_is_honoured(server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there!"}], "tools": PROVIDER_TOOLS,
            "temperature": 0, "max_output_tokens": 60, "stream": False}
    status, forced = server.json("POST", "/api/chat", {**body, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert status == 200, forced
    (call,) = forced["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and isinstance(call["function"]["arguments"]["city"], str)
    status, required = server.json("POST", "/api/chat", {**body, "tool_choice": "required"})
    assert status == 200 and required["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    status, none = server.json("POST", "/api/chat", {**body, "tool_choice": "none"})
    assert status == 200 and "tool_calls" not in none["message"]
    status, refused = server.json("POST", "/api/chat", {**body, "tool_choice": {"type": "function", "name": "nope"}})
    assert status == 400 and "tool_choice" in refused["error"]


def test_create_copy_and_delete_as_the_ollama_client_does(server, ollama_client) -> None:
    import ollama

    progress = ollama_client.create(model="terse", from_=MODEL, system="Answer in one word.",
                                    parameters={"temperature": 0, "num_predict": 3})
    assert progress.status == "success"
    names = [m.model for m in ollama_client.list().models]
    assert "terse:latest" in names and any(n.startswith(MODEL) for n in names)
    shown = ollama_client.show("terse")
    assert "num_predict 3" in shown.parameters and "SYSTEM" in shown.modelfile and "tools" in shown.capabilities
    answer = ollama_client.chat(model="terse", messages=[{"role": "user", "content": "Tell me a long story."}])
    assert answer.eval_count <= 3  # the created model's parameters
    longer = ollama_client.chat(model="terse", messages=[{"role": "user", "content": "Tell me a long story."}],
                                options={"num_predict": 6})
    assert longer.eval_count == 6  # the request's own options win
    # The created system prompt is the prompt's, as if the request had sent it.
    same = ollama_client.chat(model=MODEL, messages=[{"role": "system", "content": "Answer in one word."},
                                                     {"role": "user", "content": "Tell me a long story."}],
                              options={"num_predict": 1})
    assert answer.prompt_eval_count == same.prompt_eval_count

    assert ollama_client.copy("terse", "terse-copy").status == "success"
    assert ollama_client.chat(model="terse-copy", messages=[{"role": "user", "content": "Hi"}]).eval_count <= 3
    assert ollama_client.delete("terse").status == "success"
    names = [m.model for m in ollama_client.list().models]
    assert "terse:latest" not in names and "terse-copy:latest" in names and any(n.startswith(MODEL) for n in names)
    ollama_client.copy(MODEL, "plain-copy")  # an installed model copies as a plain new name
    assert ollama_client.chat(model="plain-copy", messages=[{"role": "user", "content": "Hi"}],
                              options={"num_predict": 2}).done

    with pytest.raises(ollama.ResponseError) as missing:
        ollama_client.create(model="x", from_="no-such-model")
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as go_template:
        ollama_client.create(model="x", from_=MODEL, template="{{ .System }} {{ .Prompt }}")
    assert go_template.value.status_code == 400 and "Jinja" in go_template.value.error
    with pytest.raises(ollama.ResponseError) as shadowing:
        ollama_client.create(model=MODEL, from_=MODEL, system="x")
    assert shadowing.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as bad:
        ollama_client.create(model="x", from_=MODEL, parameters={"temperature": "hot"})
    assert bad.value.status_code == 400 and "parameters.temperature" in bad.value.error


def test_a_created_jinja_template_is_the_one_rendered(server, ollama_client) -> None:
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    ollama_client.create(model="plain-chat", from_=MODEL, template=template)
    mine = ollama_client.chat(model="plain-chat", messages=[{"role": "user", "content": "Hi"}],
                              options={"num_predict": 1})
    own = ollama_client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 1})
    assert mine.prompt_eval_count < own.prompt_eval_count  # no ChatML markers, no default system prompt
    assert ollama_client.show("plain-chat").template == template


# --- item 6: Open WebUI's built-in tools on a template without tool support ----------------------
OPEN_WEBUI_TOOL_NAMES = [
    "notify", "get_current_timestamp", "calculate_timestamp", "search_web", "fetch_url", "generate_image",
    "edit_image", "search_memories", "add_memory", "replace_memory_content", "delete_memory", "list_memories",
    "search_notes", "view_note", "write_note", "replace_note_content", "search_chats", "view_chat",
    "search_channels", "search_channel_messages", "view_channel_message", "view_channel_thread",
    "list_knowledge_bases", "search_knowledge_bases", "query_knowledge_bases", "search_knowledge_files",
    "query_knowledge_files", "view_knowledge_file", "view_file", "grep_knowledge", "list_memory_paths",
    "read_memory_path", "update_memories", "execute_code", "get_skill", "stop_task"]


def open_webui_tools() -> list[dict]:
    """36 tools shaped as Open WebUI 0.12.4 sends its built-ins (a docstring's lines as the
    description, each parameter with its own description), about 24.8 KB as JSON like theirs."""
    tools = []
    for name in OPEN_WEBUI_TOOL_NAMES:
        words = name.replace("_", " ")
        tools.append({"type": "function", "function": {
            "name": name,
            "description": f"Use this to {words} for the user. " + (
                f"Call it when the conversation needs to {words}; results come back as JSON with the fields "
                "the user interface shows, and an error field when the request could not be completed. "),
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": f"The text to {words} with, as the user would write it"},
                "count": {"type": "integer", "description": "How many results to return (default: the admin's setting)"},
                "view": {"type": "string", "enum": ["list", "full"], "description": "How much of each result to show"},
            }, "required": ["query"]}}})
    return tools


def test_open_webui_tools_cost_a_quarter_of_their_json(server) -> None:
    import json as _json

    from localserve.api.templates import TOOL_SYSTEM_PROMPT

    tools = open_webui_tools()
    assert 24_000 < len(_json.dumps(tools)) < 26_000
    messages = [{"role": "user", "content": "Hi"}]
    status, answer = server.json("POST", "/api/chat", {"model": MODEL, "messages": messages, "tools": tools,
                                                       "stream": False, "options": {"num_predict": 1}})
    assert status == 200, answer
    # Today's cost: the same system prompt with every tool's JSON, as the fallback wrote it before.
    full = TOOL_SYSTEM_PROMPT.format(tools="\n".join(_json.dumps(t, ensure_ascii=False) for t in tools))
    before = len(server.call(_tokenize(server, full)))
    assert answer["prompt_eval_count"] < before / 4, (answer["prompt_eval_count"], before)
    assert answer["context_left"] == 2048 - answer["prompt_eval_count"] - answer["eval_count"]
