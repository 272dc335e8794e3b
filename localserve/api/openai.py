"""The OpenAI dialect without HTTP: a validated body in, engine work, the response object out.

One function per endpoint (`chat_completion`, `completion`) runs a parsed call through a
ModelManager and returns the exact JSON object the HTTP route answers with. The routes
(openai_routes.py) keep only what is HTTP: reading the body, SSE, watching the connection. A batch
runner feeds a JSONL line's body through the same parse_* and the same function, so a batch line
and an HTTP request cannot drift apart.

Each endpoint has three parts: `parse_*` (every field checked before any model is loaded, so a
bad body never costs a load), `prepare` (with the loaded engine: template, tokenize, build the
GenerationRequests) and `*_response` (collected choices -> the response object). Streaming routes
use the same parse and prepare and format chunks themselves. The pieces of the response objects
(ids, logprobs, finish reasons) are openai_shapes.py's; /v1/embeddings is openai_embeddings.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncContextManager, Callable, Sequence, TypeVar

from ..config.settings import Settings
from ..protocol.engine import ModelEngine, TextEngine
from ..protocol.requests import MAX_LOGPROBS, GenerationRequest, Lane, TextPrompt, Usage
from .live import mark_fim
from .generation import (
    Choice,
    Run,
    UsageTotals,
    chat_template,
    check_tokens,
    collect,
    generation,
    is_token_list,
    tokenize_async,
    with_seed_offset,
)
from .images import ImageParts
from .fim import fim_prompt_async, prompt_budget
from .lora import checked_lora, parse_lora, refuse_remote_lora
from .metrics import Metrics
from .openai_shapes import CHAT_PREFIX, COMPLETION_PREFIX, Head, chat_logprobs, completion_logprobs, finish_reason
from .templates import ChatTemplate
from .reasoning import REASONING_FORMATS, Thoughts
from .think_budget import chat_reasoning, engine_thinking, think_tags
from .tools import forced_call_schema, parse_tool_calls, tool_choice_plan
from .validation import (
    MAX_PROMPTS,
    Body,
    clamp_max_tokens,
    invalid,
    parse_json_format,
    parse_keep_alive,
    parse_lane,
    parse_logit_bias,
    parse_messages,
    parse_n,
    parse_seed,
    parse_stop,
    parse_tools,
    sampling_from,
)

if TYPE_CHECKING:
    from ..runtime.manager import ModelManager

MAX_TOKENS_LIMIT = (1 << 63) - 1  # bigger asks are clamped to the context left, not refused
MAX_FIM_CHARS = 1 << 20  # a suffix as long as a prompt may be; the context cuts it further


@dataclass
class ApiEnv:
    """What an endpoint needs besides the body, as plain values: the app's settings, manager and
    metrics (None: nothing to count), and the X-Priority header's value, if there was one."""

    settings: Settings
    manager: "ModelManager"
    metrics: Metrics | None = None
    priority_header: str | None = None


# --- fields shared by chat and completions -------------------------------------------------------
@dataclass
class Options:
    model: str
    stream: bool
    include_usage: bool
    n: int
    stop: list[str]
    max_tokens: int | None
    seed: int | None
    logprobs: int | None  # None = off, k = chosen token + k alternatives
    json_schema: dict | None
    lane: Lane
    keep_alive: float | None
    speculative: bool = True  # our extension: false turns speculative decoding off for this request
    default_max_tokens: int = 0  # where max_tokens is None, the setting default_max_tokens (0: no limit)
    lora: list[tuple[int, float]] | None = None  # llama-server's `lora` (api/lora.py); None: the model's own


def parse_options(body: Body, env: ApiEnv, *, chat: bool) -> Options:
    stream = body.get_bool("stream", False)
    stream_options = body.get_object("stream_options")
    if stream_options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if chat:
        max_tokens = body.get_int("max_completion_tokens", None, lo=1, hi=MAX_TOKENS_LIMIT)
        if max_tokens is None:
            max_tokens = body.get_int("max_tokens", None, lo=1, hi=MAX_TOKENS_LIMIT)
        want = body.get_bool("logprobs", False)
        top = body.get_int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want:
            raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        max_tokens = body.get_int("max_tokens", 16, lo=1, hi=MAX_TOKENS_LIMIT)  # OpenAI's default for completions
        logprobs = body.get_int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    model = body.get_str("model", None, max_len=512) or env.settings.default_model
    options = Options(
        model=model,
        stream=stream,
        include_usage=stream_options.get_bool("include_usage", False) if stream_options else False,
        n=parse_n(body),
        stop=parse_stop(body.raw("stop")),
        max_tokens=max_tokens,
        seed=parse_seed(body),
        logprobs=logprobs,
        json_schema=parse_json_format(body.raw("response_format"), "response_format"),
        # A streamed chat and a fill-in-the-middle (someone typing waits on it) are interactive.
        lane=parse_lane(body, env.priority_header,
                        "interactive" if (chat and stream) or body.raw("suffix") is not None else "default"),
        keep_alive=parse_keep_alive(body.raw("keep_alive")),
        speculative=body.get_bool("speculative", True),
        default_max_tokens=env.settings.default_max_tokens,
        lora=parse_lora(body, model),
    )
    build_request(body, options, None, [1])  # sampling fields fail here, before any model load
    return options


def build_request(body: Body, opts: Options, engine: ModelEngine | None, tokens: list[int], *,
                  param: str = "messages") -> GenerationRequest:
    """The engine request of one choice; with engine=None only checks the body's sampling fields."""
    n_vocab = engine.info.n_vocab if engine is not None else None
    n_ctx = engine.n_ctx_per_seq if engine is not None else len(tokens) + 1
    sampling = sampling_from(body, n_vocab=n_vocab, seed=opts.seed, logit_bias=parse_logit_bias(body.raw("logit_bias")),
                             json_schema=opts.json_schema, logprobs=opts.logprobs)
    return GenerationRequest(
        prompt_tokens=tokens,
        sampling=sampling,
        max_tokens=clamp_max_tokens(opts.max_tokens, len(tokens), n_ctx, param, default=opts.default_max_tokens),
        stop=opts.stop,
        lane=opts.lane,
        speculative=opts.speculative,
        lora=checked_lora(opts.lora, engine) if engine is not None else None,
    )


# The generation fields a TextEngine (a remote upstream) receives as the client sent them.
FORWARDED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                    "repeat_penalty", "seed", "stop", "max_tokens", "max_completion_tokens", "logit_bias",
                    "response_format", "logprobs", "top_logprobs")


def text_request(body: Body, opts: Options, prompt: TextPrompt) -> GenerationRequest:
    """The request of one choice for an engine that templates and tokenizes itself: our checks
    ran in parse_*, the client's own fields travel on in `prompt.options`."""
    sampling = sampling_from(body, n_vocab=None, seed=opts.seed, logit_bias=parse_logit_bias(body.raw("logit_bias")),
                             json_schema=opts.json_schema, logprobs=opts.logprobs)
    refuse_remote_lora(opts.lora, opts.model)
    prompt.options = {name: body.raw(name) for name in FORWARDED_FIELDS if body.has(name)}
    return GenerationRequest(prompt_tokens=[], sampling=sampling, max_tokens=opts.max_tokens or 0, stop=opts.stop,
                             lane=opts.lane, text=prompt)


def observe(env: ApiEnv, model: str, usages: Sequence[Usage | None]) -> None:
    if env.metrics is not None:
        for usage in usages:
            env.metrics.observe_usage(model, usage)


# --- chat ----------------------------------------------------------------------------------------
@dataclass
class ChatCall:
    body: Body
    opts: Options
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # the tools the model may call (none when tool_choice is "none")
    forced: list[dict[str, Any]] | None  # tools one of which must be called
    # Extra template variables (Anthropic's `thinking` sets enable_thinking), text the answer
    # continues (Anthropic's prefill: a last assistant turn), and the prompt rendered.
    template_args: dict[str, Any] = field(default_factory=dict)
    continuation: str = ""
    prompt: str = ""
    images: ImageParts = field(default_factory=ImageParts)  # the messages' images, in prompt order
    think_budget: int | None = None  # thinking tokens before the engine closes the block (think_budget.py)
    # `reasoning_format` (llama-server's field): "none" keeps a reasoning model's thinking in the
    # content as written; else it comes apart in `reasoning_content`. think_inside, set by
    # prepare where it comes apart: whether the prompt opened the think block (reasoning.Thoughts).
    reasoning_apart: bool = True
    think_inside: bool | None = None

    async def render(self, engine: ModelEngine, template: ChatTemplate | None = None) -> str:
        """The prompt the model's chat template makes of the conversation (kept in `prompt`)."""
        template = template or chat_template(engine)
        self.prompt = await template.render_async(self.messages, tools=self.tools or None, **self.template_args)
        self.prompt += self.continuation
        return self.prompt

    async def prompt_tokens(self, engine: ModelEngine) -> list[int]:
        """The rendered chat template's tokens (the text kept in `prompt`); a model without a
        projector refuses the request's images first."""
        images = self.images.for_model(engine)
        template = chat_template(engine)
        return await tokenize_async(engine, await self.render(engine, template), template, images=images)

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        self.images.for_model(engine)
        if isinstance(engine, TextEngine):
            if self.tools:
                # The upstream answers tool calls as structured deltas, which we do not relay yet.
                raise invalid(f"'tools' are not supported with the remote model {engine.name}", "tools")
            base = text_request(self.body, self.opts, TextPrompt("chat", messages=self.body.raw("messages")))
            return [with_seed_offset(base, i) for i in range(self.opts.n)]
        tokens = await self.prompt_tokens(engine)
        base = build_request(self.body, self.opts, engine, tokens, param="messages")
        base.images = self.images.for_model(engine)
        base.stop = base.stop + chat_template(engine).stops
        if self.forced:
            base.sampling.json_schema = forced_call_schema(self.forced)
            base.sampling.constraint_param = "tools"
        if base.sampling.json_schema is None and base.sampling.grammar is None:  # a grammar shapes all of it
            template = chat_template(engine)
            base.thinking = engine_thinking(engine, template, self.prompt, self.think_budget)
            if self.reasoning_apart and base.thinking is not None and think_tags(template.source):
                self.think_inside = not base.thinking.start
        return [with_seed_offset(base, i) for i in range(self.opts.n)]


def parse_chat(body: Body, env: ApiEnv, images: ImageParts | None = None) -> ChatCall:
    """A chat body checked; `images`: the image parts a dialect that maps onto this one (Anthropic,
    Responses) already collected, their markers in the messages' text."""
    opts = parse_options(body, env, chat=True)
    images = images if images is not None else ImageParts.of(env.settings)
    messages = parse_messages(body.raw("messages"), images=images)
    images.check_markers((m["content"] for m in messages), "messages")
    tools = parse_tools(body.raw("tools"))
    served, forced = tool_choice_plan(body.raw("tool_choice"), tools, opts.json_schema, "response_format")
    budget, template_args = chat_reasoning(body)
    apart = body.get_str("reasoning_format", "auto", choices=REASONING_FORMATS) != "none"
    return ChatCall(body, opts, messages, served, forced, images=images, template_args=template_args,
                    think_budget=budget, reasoning_apart=apart)


def chat_response(call: ChatCall, head: Head, choices: Sequence[Choice]) -> dict[str, Any]:
    out = []
    for i, choice in enumerate(choices):
        thinking, answer = Thoughts(call.think_inside).whole(choice.text)
        content, calls = parse_tool_calls(answer, call.tools) if call.tools else (answer, [])
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if thinking:
            message["reasoning_content"] = thinking
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        out.append({
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(choice.logprobs, call.opts.logprobs) if call.opts.logprobs is not None else None,
            "finish_reason": "tool_calls" if calls else finish_reason(choice.finish_reason),
        })
    return {**head.of("chat.completion"), "choices": out,
            "usage": UsageTotals.of([c.usage for c in choices], call.opts.n).openai()}


async def chat_completion(call: ChatCall, env: ApiEnv) -> dict[str, Any]:
    """A non-streamed chat.completion object for a parsed call."""
    return await _collected(call, env, chat_response, CHAT_PREFIX)


# --- completions ---------------------------------------------------------------------------------
def parse_text_or_tokens(value: Any, param: str, max_items: int) -> list[str | list[int]]:
    """OpenAI's prompt/input forms: a string, an array of strings, an array of token ids, or an
    array of token-id arrays -> one entry per text."""
    if isinstance(value, str) or is_token_list(value):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_token_list(p) for p in value):
        items = list(value)
    else:
        raise invalid(f"'{param}' must be a string, an array of strings, or token ids", param)
    if len(items) > max_items:
        raise invalid(f"'{param}' may hold at most {max_items} items", param)
    if any(isinstance(p, str) and not p for p in items):
        raise invalid(f"'{param}' must not contain empty strings", param)
    return items


@dataclass
class CompletionCall:
    body: Body
    opts: Options
    prompts: list[str | list[int]]
    echoes: list[str]  # per prompt: the text to echo before its completion ("" = none)
    suffix: str | None = None  # fill-in-the-middle: the text after the cursor; each prompt is before it

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        requests = []
        for p in self.prompts:
            if self.suffix is not None:
                tokens = await self._fim_tokens(engine, p)
                base = build_request(self.body, self.opts, engine, tokens, param="prompt")
                requests.extend(with_seed_offset(base, i) for i in range(self.opts.n))
                continue
            if isinstance(engine, TextEngine):
                base = text_request(self.body, self.opts, TextPrompt("completion", prompt=p))
                requests.extend(with_seed_offset(base, i) for i in range(self.opts.n))
                continue
            if isinstance(p, str):
                tokens = await tokenize_async(engine, p)
                if not tokens:
                    raise invalid("'prompt' is empty", "prompt")
            else:
                tokens = check_tokens(p, engine.info.n_vocab, "prompt")
            base = build_request(self.body, self.opts, engine, tokens, param="prompt")
            requests.extend(with_seed_offset(base, i) for i in range(self.opts.n))
        return requests


    async def _fim_tokens(self, engine: ModelEngine, prefix: str | list[int]) -> list[int]:
        if isinstance(engine, TextEngine):
            raise invalid("fill-in-the-middle ('suffix') is served for local models only", "suffix")
        assert isinstance(prefix, str)  # parse_completion refuses token prompts with a suffix
        budget = prompt_budget(engine, self.opts.max_tokens)
        return (await fim_prompt_async(engine, self.opts.model, prefix, self.suffix or "", budget=budget)).tokens


def parse_completion(body: Body, env: ApiEnv) -> CompletionCall:
    opts = parse_options(body, env, chat=False)
    prompts = parse_text_or_tokens(body.raw("prompt"), "prompt", MAX_PROMPTS)
    suffix = body.get_str("suffix", None, max_len=MAX_FIM_CHARS) if body.raw("suffix") is not None else None
    if suffix is not None and any(not isinstance(p, str) for p in prompts):
        raise invalid("fill-in-the-middle ('suffix') takes a text prompt", "prompt")
    if suffix is not None:
        mark_fim()
    best_of = body.get_int("best_of", None, lo=1, hi=opts.n)
    if best_of is not None and best_of != opts.n:
        raise invalid("'best_of' must equal 'n' (server-side ranking is not supported)", "best_of")
    echo = body.get_bool("echo", False)
    if echo and (opts.logprobs is not None or any(not isinstance(p, str) for p in prompts)):
        raise invalid("'echo' is supported with text prompts and without 'logprobs'", "echo")
    if echo and suffix is not None:
        raise invalid("'echo' and 'suffix' cannot be combined", "echo")
    return CompletionCall(body, opts, prompts, [p if echo and isinstance(p, str) else "" for p in prompts], suffix)


def completion_response(call: CompletionCall, head: Head, choices: Sequence[Choice]) -> dict[str, Any]:
    k = call.opts.logprobs
    out = [{
        "index": i,
        "text": call.echoes[i // call.opts.n] + choice.text,
        "logprobs": completion_logprobs(choice.logprobs, k, 0) if k is not None else None,
        "finish_reason": finish_reason(choice.finish_reason),
    } for i, choice in enumerate(choices)]
    return {**head.of("text_completion"), "choices": out,
            "usage": UsageTotals.of([c.usage for c in choices], call.opts.n).openai()}


async def completion(call: CompletionCall, env: ApiEnv) -> dict[str, Any]:
    """A non-streamed text_completion object for a parsed call."""
    return await _collected(call, env, completion_response, COMPLETION_PREFIX)


# --- what chat and completions share ------------------------------------------------------------
GenerationCall = TypeVar("GenerationCall", ChatCall, CompletionCall)


def start(call: ChatCall | CompletionCall, env: ApiEnv) -> AsyncContextManager[Run]:
    """The call's generation (pinned model, submitted streams, cancelled on exit)."""
    images = call.images if isinstance(call, ChatCall) else None
    return generation(env.manager, call.opts.model, call.opts.keep_alive, call.prepare, lane=call.opts.lane,
                      images=images)


async def _collected(call: GenerationCall, env: ApiEnv,
                     respond: Callable[[GenerationCall, Head, Sequence[Choice]], dict[str, Any]],
                     prefix: str) -> dict[str, Any]:
    async with start(call, env) as run:
        choices = await collect(run.streams)
    observe(env, run.model, [c.usage for c in choices])
    return respond(call, Head(run.model, prefix), choices)
