"""Anthropic's Messages dialect without HTTP: POST /v1/messages, /v1/messages/count_tokens, and
the model list in Anthropic's shape, shared by the routes (server/anthropic_routes.py) and the
Batch API.

A Messages body is checked in Anthropic's own terms (field names, ranges: temperature 0..1,
max_tokens required) and then becomes the chat call of api/openai.py: the same lanes (`priority` /
X-Priority; a streamed message is interactive), limits, template, prefix cache and tool calls, so
a conversation answers here exactly what it answers on /v1/chat/completions. What is Anthropic's
alone is the shape: anthropic_messages.py (request blocks -> chat messages, Claude Code's volatile
billing header dropped) and anthropic_stream.py (events -> content blocks and stream events).

A last assistant turn is a prefill: the answer continues its text, as Anthropic's does.
Image blocks (`base64` and `url` sources, also inside `tool_result`) go to a model with a vision
projector, and are a 400 naming the model for one without (api/images.py). Not served, each a 400
naming the field: documents and server tools (web search, code execution). `output_config.format`
(a JSON schema) constrains the answer as the chat path's response_format does; `thinking.budget_tokens`
(type "enabled") is the engine's thinking budget, else `output_config.effort` where it names one of
our levels (Claude Code sends adaptive thinking with an effort; think_budget.py). Accepted and
without effect here: `metadata`, `cache_control` on any block (our prefix cache needs no
breakpoints: it reuses every shared prefix, and reports it as cache_read_input_tokens),
`disable_parallel_tool_use`, `service_tier`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from ..backends.common.schema_bounds import check_schema
from ..protocol.engine import TextEngine
from ..protocol.requests import GenerationEvent
from .anthropic_messages import chat_messages, chat_tool_choice, chat_tools
from .anthropic_stream import MessageStream
from .generation import Run, collect
from .images import ImageParts
from .openai import MAX_TOKENS_LIMIT, ApiEnv, ChatCall, observe, parse_chat, start
from .templates import THINK_OPEN, is_reasoning_template
from .tokenizing import chat_prompt
from .think_budget import EFFORT_BUDGETS
from .validation import Body, invalid, parse_stop

MESSAGE_PREFIX = "msg_"
# Fields that mean the same on the chat path and travel there as they are.
_SAME_FIELDS = ("model", "stream", "top_p", "top_k", "priority", "keep_alive", "seed")


@dataclass
class MessagesCall:
    chat: ChatCall  # the same call /v1/chat/completions makes
    thinking: bool  # the request asked to see the model's reasoning
    stops: list[str]

    @property
    def stream(self) -> bool:
        return self.chat.opts.stream


def _thinking(body: Body) -> tuple[bool, int | None]:
    """(whether the request asked to see the model's reasoning, its budget in tokens: Anthropic's
    `budget_tokens` with type "enabled")."""
    thinking = body.get_object("thinking")
    if thinking is None:
        return False, None
    kind = thinking.get_str("type", None, choices=("enabled", "disabled", "adaptive", "between_tools"))
    if kind is None:
        raise invalid("'thinking.type' is required", "thinking.type")
    budget = thinking.get_int("budget_tokens", None, lo=1, hi=MAX_TOKENS_LIMIT)
    display = thinking.get_str("display", None, choices=("summarized", "omitted"))
    return kind != "disabled" and display != "omitted", budget if kind == "enabled" else None


def _effort_budget(body: Body) -> int | None:
    """output_config.effort as a budget where it is one of our levels ("max", or a level yet to
    come, thinks without a limit)."""
    config = body.get_object("output_config")
    effort = config.get_str("effort", None, max_len=64) if config is not None else None
    return EFFORT_BUDGETS.get(effort) if effort is not None else None


def _output_format(body: Body) -> dict[str, Any] | None:
    """output_config.format (structured outputs) as the chat path's response_format."""
    config = body.get_object("output_config")
    fmt = config.get_object("format") if config is not None else None
    if config is not None:
        config.get_str("effort", None, max_len=64)  # any level; ours set a budget (_effort_budget)
    if fmt is None:
        return None
    fmt.get_str("type", None, choices=("json_schema",))
    schema = fmt.get_object("schema")
    if schema is None:
        raise invalid("'output_config.format.schema' is required", "output_config.format.schema")
    check_schema(schema.data, "output_config.format.schema")  # its bounds, named in Anthropic's terms
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema.data}}


def parse_messages(body: Body, env: ApiEnv, *, count_only: bool = False) -> MessagesCall:
    """A Messages body (or count_tokens', which has no max_tokens) checked before any model load."""
    max_tokens = body.get_int("max_tokens", None, lo=1, hi=MAX_TOKENS_LIMIT)
    if max_tokens is None and not count_only:
        raise invalid("'max_tokens' is required", "max_tokens")
    temperature = body.get_float("temperature", None, lo=0.0, hi=1.0)
    stops = parse_stop(body.get_list("stop_sequences", max_items=1 << 10), "stop_sequences")
    metadata = body.get_object("metadata")
    if metadata is not None:
        metadata.get_str("user_id", None, max_len=256)
    tools = chat_tools(body.raw("tools"))
    chat: dict[str, Any] = {name: body.raw(name) for name in _SAME_FIELDS if body.has(name)}
    images = ImageParts.of(env.settings)
    chat.update(messages=chat_messages(body.raw("system"), body.raw("messages"), images), stop=stops,
                max_tokens=max_tokens, temperature=temperature, tools=tools or None,
                tool_choice=chat_tool_choice(body), response_format=_output_format(body))
    if count_only:
        chat.pop("stream", None)
    thinking, call_budget = _thinking(body)
    call = parse_chat(Body({k: v for k, v in chat.items() if v is not None}), env, images)
    # A reasoning template (Qwen3's) thinks only when asked, as Anthropic's models do.
    call.template_args = {"enable_thinking": thinking}
    call.think_budget = call_budget if call_budget is not None else _effort_budget(body)
    last = call.messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and len(call.messages) > 1:
        # Prefill: the answer continues the last assistant turn instead of starting a new one.
        call.messages, call.continuation = call.messages[:-1], last["content"]
    return MessagesCall(call, thinking, stops)


def message_stream(call: MessagesCall, run: Run) -> MessageStream:
    """The machine that turns `run`'s events into the message's blocks and stream events."""
    engine = run.engine
    template = "" if isinstance(engine, TextEngine) else (engine.info.chat_template or "")
    return MessageStream(
        {"id": f"{MESSAGE_PREFIX}{uuid.uuid4().hex[:24]}", "model": run.model},
        tools=call.chat.tools, reasoning=is_reasoning_template(template),
        starts_thinking=call.chat.prompt.rstrip().endswith(THINK_OPEN), show_thinking=call.thinking,
        stops=call.stops, detokenize=engine.detokenize, prompt_tokens=len(run.requests[0].prompt_tokens),
    )


async def create_message(call: MessagesCall, env: ApiEnv) -> dict[str, Any]:
    """The non-streamed message object for a parsed call."""
    async with start(call.chat, env) as run:
        (choice,) = await collect(run.streams)
        stream = message_stream(call, run)  # fed while the model is pinned: it detokenizes
        stream.feed(GenerationEvent(text=choice.text, token_ids=choice.token_ids,
                                    finish_reason=choice.finish_reason, usage=choice.usage))
    observe(env, run.model, [choice.usage])
    return stream.final()


async def count_tokens(call: MessagesCall, env: ApiEnv) -> dict[str, int]:
    """{"input_tokens": N}: the prompt the model would be given, system, tools and images included
    (the same rendering and tokenizer as /tokenize's chat form, api/tokenizing.py)."""
    await call.chat.images.resolve()
    return {"input_tokens": len((await chat_prompt(call.chat, env, "counting tokens")).tokens)}


# --- models --------------------------------------------------------------------------------------
def model_info(entry: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI model entry (openai_routes) in Anthropic's shape."""
    created = dt.datetime.fromtimestamp(max(0, entry.get("created") or 0), dt.timezone.utc)
    return {"type": "model", "id": entry["id"], "display_name": entry["id"],
            "created_at": created.isoformat().replace("+00:00", "Z"), "lifecycle": "active"}


def model_list(entries: list[dict[str, Any]]) -> dict[str, Any]:
    data = [model_info(e) for e in entries]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
