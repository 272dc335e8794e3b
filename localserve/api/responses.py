"""The OpenAI Responses dialect without HTTP (POST /v1/responses, what Codex CLI and Copilot CLI speak).

A Responses request is a chat conversation in other clothes, so it takes the chat path whole: its
input items, instructions, tools, tool_choice, max_output_tokens and text.format become the body
/v1/chat/completions would get (responses_items.py), which `parse_chat` validates and `ChatCall`
templates, tokenizes and submits: the same checks, lanes (`priority`, X-Priority), limits, prefix
cache and engines, and for greedy decoding the same answer, token for token, as that chat request.
localserve's sampling extensions the chat route takes (seed, top_k, min_p, penalties, logit_bias,
stop, keep_alive) pass through too. An error the chat path raises names the Responses field
(`RENAMED`). Fields with no meaning here (`background`, `conversation`, `prompt`, truncation
"auto") are 400s naming them rather than silently different behaviour.

State: with `store` (the default) the answered response and the conversation it answered are kept
(response_store.py: each item once, a continuation as a link to the response it continues, an
`item_reference` as a link to the item); `previous_response_id` rebuilds that conversation, its
output included, in front of the new input, so the new prompt starts with the previous one's
tokens and the prefix cache serves them (usage.input_tokens_details.cached_tokens).
`instructions` are not carried over, as OpenAI documents.

`create_response` is the non-streamed endpoint (the Batch API runs lines through it);
responses_stream.py turns the same generation into the Responses event stream.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Iterator, Sequence

from ..errors import InvalidRequestError
from ..protocol.engine import ModelEngine, TextEngine
from ..protocol.requests import GenerationRequest, SamplingParams, Usage
from .tools import ToolCall, parse_tool_calls
from .generation import Choice, Run, collect, generation
from .reasoning import OPEN as THINK_OPEN, split_thinking
from .images import ImageParts
from .openai import ApiEnv, ChatCall, observe, parse_chat
from .response_store import ResponseStore, StoredItem
from .responses_items import chat_messages, new_id, parse_input
from .responses_tools import ResponsesTools, chat_tool_choice, parse_tools
from .validation import Body, invalid

# Fields the chat path reads under the same name.
PASSED = ("model", "temperature", "top_p", "stream", "priority", "keep_alive", "seed", "top_k", "min_p",
          "frequency_penalty", "presence_penalty", "repeat_penalty", "penalty_last_n", "logit_bias", "stop")
# The chat path's param names in its errors -> this dialect's.
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}
UNSUPPORTED = {
    "background": "background responses are not supported; send the request without it (or stream it)",
    "conversation": "conversations are not supported; continue a stored response with 'previous_response_id'",
    "prompt": "reusable prompt templates are not supported; send 'instructions' and 'input'",
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed", "none")  # "none": Codex's config offers it
_THINK_TAIL_TOKENS = 8  # prompt tokens read back to see whether the template opened a <think> block
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512


@contextlib.contextmanager
def responses_params() -> Iterator[None]:
    """Errors of the chat path name this dialect's fields."""
    try:
        yield
    except InvalidRequestError as e:
        for chat, ours in RENAMED.items():
            if e.param and (e.param == chat or e.param.startswith((chat + ".", chat + "["))):
                # A message's index is not its item's (instructions and function calls move them).
                e.param = ours if chat == "messages" else ours + e.param[len(chat):]
                e.message = e.message.replace(f"'{chat}", f"'{ours}")
                break
        raise


@dataclass
class ResponsesCall:
    body: Body
    items: list[dict[str, Any]]  # this request's input, as canonical items
    instructions: str | None
    previous_id: str | None
    store: bool
    parallel_tool_calls: bool
    tools: ResponsesTools
    chat: ChatCall  # this request's input alone through parse_chat (every field checked before any load)
    echo: dict[str, Any]  # the request's settings, as the response object repeats them
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def _chat_body(body: Body, instructions: str | None, items: list[dict[str, Any]], tools: ResponsesTools,
               images: ImageParts, own_from: int) -> Body:
    data: dict[str, Any] = {name: body.raw(name) for name in PASSED if body.has(name)}
    data["messages"] = chat_messages(instructions, items, images, own_from)
    data["tools"] = tools.chat or None
    data["tool_choice"] = chat_tool_choice(body.raw("tool_choice"))
    data["max_completion_tokens"] = body.raw("max_output_tokens")
    reasoning = body.raw("reasoning")
    data["reasoning_effort"] = reasoning.get("effort") if isinstance(reasoning, dict) else None
    text = body.get_object("text")
    data["response_format"] = _response_format(text.raw("format")) if text is not None else None
    return Body({k: v for k, v in data.items() if v is not None})


def _response_format(value: Any) -> Any:
    """text.format ({"type": "json_schema", "name", "schema"}) as chat's response_format."""
    if isinstance(value, dict) and value.get("type") == "json_schema":
        if not isinstance(value.get("schema"), dict):
            raise invalid("'text.format.schema' must be a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": value.get("name"), "schema": value["schema"]}}
    return value


def _chat_call(body: Body, env: ApiEnv, instructions: str | None, items: list[dict[str, Any]],
               tools: ResponsesTools, own_from: int = 0) -> ChatCall:
    """`items` through parse_chat; those before `own_from` are a stored conversation's."""
    images = ImageParts.of(env.settings)
    with responses_params():
        return parse_chat(_chat_body(body, instructions, items, tools, images, own_from), env, images)


def parse_responses(body: Body, env: ApiEnv) -> ResponsesCall:
    """Every field checked, before any model is loaded or any stored response read."""
    for name, why in UNSUPPORTED.items():
        if body.raw(name) not in (None, False):
            raise invalid(f"'{name}': {why}", name)
    truncation = body.get_str("truncation", "disabled", choices=("disabled", "auto"))
    if truncation == "auto":
        raise invalid("'truncation': only \"disabled\" is supported (an input past the context is a 400)", "truncation")
    instructions = body.get_str("instructions", None)
    items = parse_input(body.raw("input"))
    previous = body.get_str("previous_response_id", None, max_len=256)
    include = body.get_list("include", max_items=64)
    if include is not None and not all(isinstance(x, str) for x in include):
        raise invalid("'include' must be an array of strings", "include")
    tools = parse_tools(body.raw("tools"))
    chat = _chat_call(body, env, instructions, items, tools)
    return ResponsesCall(
        body=body, items=items, instructions=instructions, previous_id=previous,
        store=body.get_bool("store", True),
        parallel_tool_calls=body.get_bool("parallel_tool_calls", True),
        tools=tools, chat=chat, echo=_echo(body, chat, tools),
    )


def _echo(body: Body, chat: ChatCall, tools: ResponsesTools) -> dict[str, Any]:
    """What the response object says about the request: its settings as they apply."""
    defaults = SamplingParams()
    reasoning = body.get_object("reasoning")
    effort = summary = None
    if reasoning is not None:
        effort = reasoning.get_str("effort", None, choices=REASONING_EFFORTS)
        summary = reasoning.get_str("summary", None, choices=REASONING_SUMMARIES)
    text = body.get_object("text")
    fmt = text.raw("format") if text is not None else None
    return {
        "instructions": body.raw("instructions"),
        "max_output_tokens": chat.opts.max_tokens,
        "metadata": _metadata(body.raw("metadata")),
        "reasoning": {"effort": effort, "summary": summary},
        "temperature": body.get_float("temperature", defaults.temperature, lo=0, hi=2),
        "top_p": body.get_float("top_p", defaults.top_p, lo=0, hi=1),
        "text": {"format": fmt if isinstance(fmt, dict) else {"type": "text"}},
        "tool_choice": _tool_choice_echo(body.raw("tool_choice", "auto")),
        "tools": tools.echo,
        "truncation": "disabled",
    }


def _tool_choice_echo(value: Any) -> Any:
    """tool_choice as the response repeats (and stores) it: a named function by its name alone,
    not whatever else the client put in the object (chat_tool_choice checked it already)."""
    return {"type": "function", "name": value["name"]} if isinstance(value, dict) else value


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise invalid(f"'metadata' must be an object of at most {MAX_METADATA} string pairs", "metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise invalid("'metadata' keys must be at most 64 characters and its values strings of at most 512",
                          "metadata")
    return dict(value)


# --- the conversation, with a stored previous response -------------------------------------------
@dataclass
class Conversation:
    """The call with its whole conversation: the previous response's (if any) and this input."""

    call: ResponsesCall
    chat: ChatCall
    # This request's input as it is stored: a new item, or a stored one (an item_reference, by its
    # row). The earlier turns are the previous response's and stay there.
    inputs: list[dict[str, Any] | StoredItem]
    thinking_open: bool = False  # the template's prompt ends inside a <think> block (set by prepare)

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        with responses_params():
            requests = await self.chat.prepare(engine)
        for request in requests:  # what the engine's grammar errors name, mid-stream too
            sampling = request.sampling
            sampling.constraint_param = RENAMED.get(sampling.constraint_param, sampling.constraint_param)
        if requests and requests[0].prompt_tokens and not isinstance(engine, TextEngine):
            tail = engine.detokenize(requests[0].prompt_tokens[-_THINK_TAIL_TOKENS:])
            self.thinking_open = tail.rstrip().endswith(THINK_OPEN)
        return requests


async def conversation(call: ResponsesCall, env: ApiEnv) -> Conversation:
    """The call's conversation: a stored previous response's rebuilt in front (404 if none), and
    item references replaced by the stored items they name (400 if none, or if they add up to
    more than a request body may hold: response_store.py)."""
    references = [item["id"] for item in call.items if item["type"] == "item_reference"]
    if call.previous_id is None and not references:
        return Conversation(call, call.chat, list(call.items))
    resolved = await ResponseStore.of(env.settings).resolve(call.previous_id, references,
                                                            env.settings.max_body_bytes)
    inputs: list[dict[str, Any] | StoredItem] = []
    for item in call.items:
        if item["type"] == "item_reference":
            if item["id"] not in resolved.references:
                raise invalid(f"'{item['_param']}': no stored item with id {item['id'][:80]!r}", item["_param"])
            inputs.append(resolved.references[item["id"]])
        else:
            inputs.append(item)
    context = [s.item for s in resolved.history] + [e.item if isinstance(e, StoredItem) else e for e in inputs]
    return Conversation(call, _chat_call(call.body, env, call.instructions, context, call.tools,
                                         own_from=len(resolved.history)), inputs)


def start(conv: Conversation, env: ApiEnv) -> AsyncContextManager[Run]:
    """The conversation's generation (pinned model, submitted stream, cancelled on exit)."""
    opts = conv.chat.opts
    return generation(env.manager, opts.model, opts.keep_alive, conv.prepare, images=conv.chat.images)


# --- the response object -------------------------------------------------------------------------
def response_object(call: ResponsesCall, model: str, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, *, error: dict[str, Any] | None = None,
                    incomplete: str | None = None) -> dict[str, Any]:
    """OpenAI's response object: `status` in_progress, completed, incomplete or failed."""
    return {
        "id": call.id, "object": "response", "created_at": call.created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "model": model, "output": output, "parallel_tool_calls": call.parallel_tool_calls,
        "previous_response_id": call.previous_id, "store": call.store, "usage": usage, "user": None,
        **call.echo,
    }


def usage_object(usage: Usage | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens if usage else 0},
        "output_tokens": completion,
        # The engine's count where it kept one (the think block's own tokens), else the text's.
        "output_tokens_details": {"reasoning_tokens": (usage.reasoning_tokens if usage and usage.reasoning_tokens
                                                       else reasoning_tokens)},
        "total_tokens": prompt + completion,
    }


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, tools: ResponsesTools) -> dict[str, Any]:
    item = {"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
            "name": call.name, "arguments": call.arguments}
    if call.name in tools.namespaces:
        item["namespace"] = tools.namespaces[call.name]
    return item


def reasoning_item(text: str) -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete_details.reason) of a finished generation."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)


def finished_output(conv: Conversation, text: str, finish_reason: str | None,
                    engine: ModelEngine | None) -> tuple[list[dict[str, Any]], int]:
    """(output items, reasoning tokens) of a whole answer: reasoning, message, function calls."""
    status, _ = status_of(finish_reason)
    thinking, text = split_thinking(text, conv.thinking_open)
    output: list[dict[str, Any]] = []
    reasoning_tokens = 0
    if thinking is not None:
        output.append(reasoning_item(thinking))
        reasoning_tokens = count_tokens(engine, thinking)
    content, calls = parse_tool_calls(text, conv.chat.tools) if conv.chat.tools else (text, [])
    if not conv.call.parallel_tool_calls:
        calls = calls[:1]
    if content or not calls:
        output.append(message_item(content, status))
    output.extend(call_item(c, conv.call.tools) for c in calls)
    return output, reasoning_tokens


def count_tokens(engine: ModelEngine | None, text: str) -> int:
    """Tokens of `text` as the model counts them (0 for a remote model, which tokenizes upstream)."""
    if engine is None or not text or isinstance(engine, TextEngine):
        return 0
    return len(engine.tokenize(text, add_special=False))


def final_response(conv: Conversation, model: str, choice: Choice, engine: ModelEngine | None) -> dict[str, Any]:
    output, reasoning_tokens = finished_output(conv, choice.text, choice.finish_reason, engine)
    status, incomplete = status_of(choice.finish_reason)
    return response_object(conv.call, model, status, output, usage_object(choice.usage, reasoning_tokens),
                           incomplete=incomplete)


async def keep(conv: Conversation, response: dict[str, Any], env: ApiEnv) -> None:
    """Store the answered response (when the request asked to) for GET and continuations."""
    if conv.call.store:
        await ResponseStore.of(env.settings).save(response, conv.call.previous_id, conv.inputs)


async def create_response(call: ResponsesCall, env: ApiEnv) -> dict[str, Any]:
    """The non-streamed response object for a parsed call (stored when `store`)."""
    conv = await conversation(call, env)
    async with start(conv, env) as run:
        choices: Sequence[Choice] = await collect(run.streams)
        engine = run.engine
    observe(env, run.model, [c.usage for c in choices])
    response = final_response(conv, run.model, choices[0], engine)
    await keep(conv, response, env)
    return response


# --- stored responses ----------------------------------------------------------------------------
async def get_response(env: ApiEnv, response_id: str) -> dict[str, Any]:
    return await ResponseStore.of(env.settings).get(response_id)


async def delete_response(env: ApiEnv, response_id: str) -> dict[str, Any]:
    await ResponseStore.of(env.settings).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def input_items(env: ApiEnv, response_id: str, query: Body) -> dict[str, Any]:
    """The items the stored response answered (the previous responses' included), as OpenAI pages
    them: `order` (desc by default), `limit` (1..100, 20), `after` an item id."""
    order = query.get_str("order", "desc", choices=("asc", "desc"))
    limit = query.get_int("limit", 20, lo=1, hi=100) or 20
    after = query.get_str("after", None, max_len=256)
    page, more = await ResponseStore.of(env.settings).input_items(response_id, order == "desc", limit, after)
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}
