"""Ollama's /api/generate and /api/chat without HTTP: a body parsed into a call (every field
checked before a model is loaded for it), the call's engine request once the model is there, and
the NDJSON lines and final answer built from its events. The routes (server/ollama_routes.py) add
reading the body, the load-only answer, NDJSON writing and the connection watch.

Both take Ollama's `images` (base64: the request's for /api/generate, each message's for /api/chat),
placed before the text they come with, as Ollama places them (api/images.py checks them).

Both calls answer in Ollama's shapes: a streamed line per piece of text, then a final line with
`done_reason` and nanosecond durations; /api/generate's final line carries `context` (the prompt
and answer tokens a client sends back to continue), /api/chat's the tool calls the model made.

A request that sets `think` (true or a level) gets a reasoning model's thinking in
`message.thinking` / `thinking` and only the answer in `content` / `response`, as Ollama answers it
(reasoning.Thoughts); without `think` the text stays as the model wrote it, tags and all, as
Ollama's older releases gave it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..protocol.engine import ModelEngine
from ..protocol.requests import GenerationEvent, GenerationRequest, Lane
from ..protocol.media import ImageInput
from .generation import Choice, Clock, chat_template, check_tokens, is_token_list, tokenize_async
from .images import ImageParts, kept_images
from .live import mark_fim
from .chat_history import answer_room, fit_history
from .ollama import (answer_length, build_request, context_note, final_fields, fim_request_tokens, model_name, now_iso,
                     request_context, request_options)
from .templates import ChatTemplate
from .reasoning import Thoughts
from .think_budget import engine_thinking, ollama_think
from .tools import ToolCallStream, forced_call_schema, parse_tool_calls, tool_choice_plan
from .validation import Body, invalid, parse_json_format, parse_keep_alive, parse_messages, parse_tools


@dataclass
class OllamaCall:
    """What both calls share: the body (its options are read again once the model is known), the
    model, streaming, keep_alive, the lane and the daemon's default answer length."""

    body: Body
    model: str
    stream: bool
    keep_alive: float | None
    priority: str | None  # the X-Priority header
    default_max_tokens: int
    lane: Lane = "default"
    template: str | None = None  # a created model's chat template, in place of the model's own
    images: ImageParts = field(default_factory=ImageParts)  # the prompt's images, in order
    think: bool | None = None  # `think`: the template's enable_thinking (None: its default)
    think_budget: int | None = None  # `think` as a level: thinking tokens (think_budget.py)
    # Set by prepare where `think` asks for the thought apart (`thinking`): whether the prompt opened it.
    think_inside: bool | None = None

    def chat_template(self, engine: ModelEngine) -> ChatTemplate:
        own = chat_template(engine)
        return replace(own, source=self.template, is_fallback=False) if self.template else own

    @property
    def template_args(self) -> dict[str, Any]:
        return {} if self.think is None else {"enable_thinking": self.think}

    def thinking(self, request: GenerationRequest, engine: ModelEngine, template: ChatTemplate, prompt: str) -> None:
        if request.sampling.json_schema is None:  # a format shapes the whole answer
            request.thinking = engine_thinking(engine, template, prompt, self.think_budget)
        if self.think and request.thinking is not None:
            self.think_inside = not request.thinking.start

    def request(self, engine: ModelEngine, tokens: list[int], interactive: bool) -> GenerationRequest:
        return build_request(self.body, self.priority, engine, tokens, interactive=interactive,
                             default_max_tokens=self.default_max_tokens)

    def final_line(self, name: str, clock: Clock, event: GenerationEvent | Choice, engine: ModelEngine,
                   **fields: Any) -> dict[str, Any]:
        line = {"model": name, "created_at": now_iso(), **fields,
                **final_fields(clock, event.usage, event.finish_reason), **context_note(self.body, engine)}
        # What the next turn has: a chat UI that shows it (or a user reading the line) sees the
        # conversation near its end before turns start being cut.
        n_ctx, _, _ = request_context(request_options(self.body), engine)
        line["context_left"] = max(0, n_ctx - line["prompt_eval_count"] - line["eval_count"])
        return line


def _common(body: Body, priority: str | None, default_max_tokens: int, images: ImageParts | None) -> dict[str, Any]:
    think, think_budget = ollama_think(body)
    return {"body": body, "model": model_name(body), "stream": body.get_bool("stream", True),
            "keep_alive": parse_keep_alive(body.raw("keep_alive")), "priority": priority,
            "default_max_tokens": default_max_tokens, "images": images if images is not None else ImageParts(),
            "think": think, "think_budget": think_budget}


# --- /api/generate -------------------------------------------------------------------------------
@dataclass
class GenerateCall(OllamaCall):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] = field(default_factory=list)  # an earlier answer's tokens, continued
    suffix: str | None = None  # fill-in-the-middle: the prompt is the text before the cursor

    @property
    def loads_only(self) -> bool:
        """An empty prompt loads the model (or, with keep_alive 0, unloads it), as Ollama does."""
        return not self.prompt and not self.context and self.suffix is None

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        images = self.images.for_model(engine)
        if self.suffix is not None:  # someone typing waits on it: interactive unless the client says otherwise
            tokens = await fim_request_tokens(self.body, engine, self.model, self.prompt, self.suffix,
                                              self.default_max_tokens)
            return [self.request(engine, tokens, interactive=True)]
        if self.raw:
            text, template = self.prompt, None
        else:
            template = self.chat_template(engine)
            system = [{"role": "system", "content": self.system}] if self.system else []
            text = await template.render_async(system + [{"role": "user", "content": self.prompt}],
                                               **self.template_args)
        # A continuation of `context`: the earlier turn already began with BOS.
        earlier = check_tokens(self.context, engine.info.n_vocab, "context") if self.context else []
        tokens = earlier + await tokenize_async(engine, text, template, add_special=not self.context, images=images)
        request = self.request(engine, tokens, interactive=False)
        request.images = images
        if template is not None:
            request.stop = request.stop + template.stops
            self.thinking(request, engine, template, text)
        return [request]


def parse_generate(body: Body, priority: str | None, default_max_tokens: int,
                   images: ImageParts | None = None) -> GenerateCall:
    call = GenerateCall(**_common(body, priority, default_max_tokens, images),
                        prompt=body.get_str("prompt", "") or "", system=body.get_str("system", None),
                        raw=body.get_bool("raw", False), context=body.get_list("context", max_items=1 << 22) or [],
                        suffix=body.get_str("suffix", None))
    sent = body.get_list("images", max_items=1 << 10) or []
    if sent and call.suffix is not None:
        raise invalid("'images' cannot be combined with 'suffix' (fill-in-the-middle)", "images")
    call.prompt = "".join(call.images.add_base64(item, f"images[{j}]") for j, item in enumerate(sent)) + call.prompt
    call.images.check_markers([call.prompt], "prompt")
    if body.get_str("template", None):
        raise invalid("a custom 'template' is not supported; the model's own chat template is used", "template")
    if call.loads_only:
        return call
    if call.suffix is not None and call.context:
        raise invalid("'suffix' (fill-in-the-middle) cannot continue a 'context'", "suffix")
    if call.suffix is not None:
        mark_fim()
    if call.context and not is_token_list(call.context):
        raise invalid("'context' must be an array of token ids", "context")
    # Bad options fail before any model load; the lane is also the one a wait for the load takes.
    call.lane = build_request(body, priority, None, [], interactive=call.suffix is not None).lane
    return call


class GenerateAnswer:
    """/api/generate's lines and final answer for one run (`prompt`: the prompt's tokens)."""

    def __init__(self, call: GenerateCall, name: str, prompt: list[int], engine: ModelEngine, clock: Clock):
        self.call, self.name, self.prompt, self.engine, self.clock = call, name, prompt, engine, clock
        self._generated: list[int] = []
        self._thoughts = Thoughts(call.think_inside)

    def line(self, event: GenerationEvent) -> dict[str, Any] | None:
        self._generated.extend(event.token_ids)
        thinking, text = self._thoughts.feed(event.text, last=event.finish_reason is not None)
        return self._text_line(text, thinking) if text or thinking else None

    def keepalive(self) -> dict[str, Any]:
        """A line with no text, `done: false`: what a silent stream sends so clients see it alive."""
        return self._text_line("")

    def _text_line(self, text: str, thinking: str = "") -> dict[str, Any]:
        return {"model": self.name, "created_at": now_iso(), "response": text, **_thinking(thinking), "done": False}

    def final(self, event: GenerationEvent) -> list[dict[str, Any]]:
        return [self.call.final_line(self.name, self.clock, event, self.engine, response="",
                                     context=self.prompt + self._generated)]

    def whole(self, choice: Choice) -> dict[str, Any]:
        thinking, text = self._thoughts.whole(choice.text)
        return self.call.final_line(self.name, self.clock, choice, self.engine, response=text, **_thinking(thinking),
                                    context=self.prompt + choice.token_ids)


def _thinking(text: str) -> dict[str, str]:
    return {"thinking": text} if text else {}


# --- /api/chat -----------------------------------------------------------------------------------
@dataclass
class ChatCall(OllamaCall):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # none when tool_choice is "none"
    forced: list[dict[str, Any]] | None = None  # tools one of which must be called
    dropped: int = 0  # the oldest turns cut so the chat fits its context (chat_history.py)

    @property
    def loads_only(self) -> bool:
        return not self.messages

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        template = self.chat_template(engine)
        images = self.images.for_model(engine)
        images_of: dict[int, list[ImageInput]] = {}  # messages kept -> their images

        prompts: list[str] = []

        async def tokens_of(messages: list[dict[str, Any]]) -> list[int]:
            prompts.append(await template.render_async(messages, tools=self.tools or None, **self.template_args))
            images_of[len(messages)] = kept_images(messages, self.messages, images)
            return await tokenize_async(engine, prompts[-1], template, images=images_of[len(messages)])

        options = request_options(self.body)
        n_ctx, _, _ = request_context(options, engine)
        budget = n_ctx - answer_room(n_ctx, answer_length(options, self.default_max_tokens))
        tokens, self.dropped = await fit_history(self.messages, tokens_of, budget)
        request = self.request(engine, tokens, interactive=self.stream)
        request.images = images_of[len(self.messages) - self.dropped]
        request.stop = request.stop + template.stops
        if self.forced:
            request.sampling.json_schema = forced_call_schema(self.forced)
            request.sampling.constraint_param = "tools"
        self.thinking(request, engine, template, prompts[-1])  # every try ends alike: its tail is the one read
        return [request]

    def final_line(self, name: str, clock: Clock, event: GenerationEvent | Choice, engine: ModelEngine,
                   **fields: Any) -> dict[str, Any]:
        line = super().final_line(name, clock, event, engine, **fields)
        if self.dropped:
            # prompt_eval_count is already the cut prompt's; this says what it left out.
            line["messages_dropped"] = self.dropped
            note = f"the oldest {self.dropped} messages were left out so that the chat fits its context"
            line["warning"] = f"{line['warning']}; {note}" if "warning" in line else note
        return line


def parse_chat(body: Body, priority: str | None, default_max_tokens: int,
               images: ImageParts | None = None) -> ChatCall:
    call = ChatCall(**_common(body, priority, default_max_tokens, images))
    raw_messages = body.get_list("messages", max_items=1 << 16)
    if not raw_messages:
        return call
    call.messages = parse_messages(raw_messages, images=call.images)
    call.images.check_markers((m["content"] for m in call.messages), "messages")
    call.tools, call.forced = tool_choice_plan(body.raw("tool_choice"), parse_tools(body.raw("tools")),
                                               parse_json_format(body.raw("format"), "format"), "format")
    # Bad options fail before any model load; the lane is also the one a wait for the load takes.
    call.lane = build_request(body, priority, None, [], interactive=call.stream).lane
    return call


class ChatAnswer:
    """/api/chat's lines and final answer for one run; a model's tool calls are held back from the
    text and come as `tool_calls` on the last line before the final one."""

    def __init__(self, call: ChatCall, name: str, engine: ModelEngine, clock: Clock):
        self.call, self.name, self.engine, self.clock = call, name, engine, clock
        self._calls = ToolCallStream(call.tools) if call.tools else None
        self._thoughts = Thoughts(call.think_inside)

    def line(self, event: GenerationEvent) -> dict[str, Any] | None:
        thinking, text = self._thoughts.feed(event.text, last=event.finish_reason is not None)
        text = self._calls.feed(text) if self._calls else text
        if not (text or thinking):
            return None
        return self._message_line(text, thinking=thinking)

    def final(self, event: GenerationEvent) -> list[dict[str, Any]]:
        lines = []
        if self._calls:
            rest, calls = self._calls.finish()
            if rest or calls:
                lines.append(self._message_line(rest, [c.ollama() for c in calls]))
        lines.append(self.call.final_line(self.name, self.clock, event, self.engine,
                                          message={"role": "assistant", "content": ""}))
        return lines

    def whole(self, choice: Choice) -> dict[str, Any]:
        thinking, text = self._thoughts.whole(choice.text)
        content, calls = parse_tool_calls(text, self.call.tools) if self.call.tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content, **_thinking(thinking)}
        if calls:
            message["tool_calls"] = [c.ollama() for c in calls]
        return self.call.final_line(self.name, self.clock, choice, self.engine, message=message)

    def keepalive(self) -> dict[str, Any]:
        """A line with no text, `done: false`: what a silent stream sends so clients see it alive."""
        return self._message_line("")

    def _message_line(self, text: str, tool_calls: list[dict[str, Any]] | None = None,
                      thinking: str = "") -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, **_thinking(thinking)}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"model": self.name, "created_at": now_iso(), "message": message, "done": False}
