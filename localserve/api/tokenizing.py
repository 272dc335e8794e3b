"""Tokens without generating: llama-server's `/tokenize`, `/detokenize` and `/apply-template`,
vLLM's `/tokenize` and `/detokenize`, and the path Anthropic's count_tokens shares with them.

One `/tokenize` answers both servers' bodies, told apart by their fields: llama-server's
`content` (`add_special`, default false; `with_pieces`) answers `{"tokens": [...]}`, each token an
id or, with pieces, `{"id", "piece"}` where the piece is a string when its bytes are whole UTF-8
and else the list of its bytes (a character split between tokens); vLLM's `messages` (a chat,
rendered as the chat path renders it) or `prompt` (`add_special_tokens`, default true) answers
`{"count", "max_model_len", "tokens", "token_strs"}`. The chat forms go through `chat_prompt`: the
very template and tokenizer a chat request takes (api/openai.py ChatCall), which count_tokens
(api/anthropic.py) counts with, so the three cannot disagree. Special tokens show as their text,
as llama-server's pieces do, so `/detokenize` of `/tokenize`'s ids gives the text back.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..protocol.engine import ModelEngine, TextEngine
from .generation import check_tokens, is_token_list, off_loop_if_long, tokenize_async
from .openai import ApiEnv, ChatCall, parse_chat
from .validation import Body, invalid, parse_keep_alive

# Token ids in one /detokenize body: as many as a token prompt may hold (api/llamacpp.py's
# MAX_PROMPT_TOKENS); an 8 MiB body holds fewer than 2M anyway.
MAX_DETOKENIZE_TOKENS = 1 << 20
_CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "keep_alive")
# Variables the template gets from the request and the model (api/templates.py ChatTemplate.render).
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@asynccontextmanager
async def local_engine(env: ApiEnv, model: str, keep_alive: float | None, what: str) -> AsyncIterator[ModelEngine]:
    """`model` pinned for work that needs its own tokenizer, which a remote model has not here."""
    async with env.manager.use(model, keep_alive=keep_alive) as loaded:
        if isinstance(loaded.engine, TextEngine):
            raise invalid(f"{what} is served for local models only, not {loaded.name}", "model")
        yield loaded.engine


@dataclass
class RenderedChat:
    prompt: str  # the chat template's text, generation prompt included
    tokens: list[int]  # what the model would be fed (empty when not asked for)
    max_model_len: int  # tokens one request may hold on this model
    pieces: list[bytes] | None = None  # each token's bytes, when asked for


async def chat_prompt(call: ChatCall, env: ApiEnv, what: str, *, tokenize: bool = True,
                      pieces: bool = False) -> RenderedChat:
    """The prompt and tokens a chat request of `call`'s conversation would give the model."""
    async with local_engine(env, call.opts.model, call.opts.keep_alive, what) as engine:
        if not tokenize:
            return RenderedChat(await call.render(engine), [], engine.n_ctx_per_seq)
        tokens = await call.prompt_tokens(engine)
        return RenderedChat(call.prompt, tokens, engine.n_ctx_per_seq,
                            await _pieces(engine, tokens) if pieces else None)


async def _pieces(engine: ModelEngine, tokens: list[int]) -> list[bytes]:
    return await off_loop_if_long(len(tokens), engine.token_pieces, tokens)


def parse_template_call(body: Body, env: ApiEnv) -> ChatCall:
    """A body with `messages` (and `tools`) as the chat call renders it; `add_generation_prompt`
    (default true, as both servers) and `chat_template_kwargs` become template variables."""
    if not body.has("messages"):
        raise invalid("'messages' is required", "messages")
    call = parse_chat(Body({k: body.raw(k) for k in _CHAT_FIELDS if body.raw(k) is not None}), env)
    kwargs = body.get_object("chat_template_kwargs")
    extra = dict(kwargs.data) if kwargs is not None else {}
    taken = sorted(set(extra) & _TEMPLATE_OWN)
    if taken:
        raise invalid(f"'chat_template_kwargs' may not set {taken[0]!r}: the request's own fields give it",
                      "chat_template_kwargs")
    call.template_args = {**extra, "add_generation_prompt": body.get_bool("add_generation_prompt", True)}
    return call


# --- /tokenize -----------------------------------------------------------------------------------
async def tokenize(body: Body, env: ApiEnv) -> dict[str, Any]:
    """The answer to a /tokenize body, in the shape of the server whose fields it carries."""
    if body.has("messages") or body.has("prompt"):
        return _vllm_answer(await _vllm_tokens(body, env), body.get_bool("return_token_strs", False))
    content = body.raw("content")
    if not isinstance(content, str):
        raise invalid("'content' is required and must be a string (or send vLLM's 'prompt' or 'messages')",
                      "content")
    add_special = body.get_bool("add_special", False)  # llama-server's default
    if not body.get_bool("parse_special", True):
        raise invalid("'parse_special' false is not supported: special tokens' text is always read as the "
                      "tokens", "parse_special")
    with_pieces = body.get_bool("with_pieces", False)
    async with local_engine(env, _model(body, env), _keep_alive(body), "tokenizing") as engine:
        tokens = await tokenize_async(engine, content, add_special=add_special)
        if not with_pieces:
            return {"tokens": tokens}
        pieces = await _pieces(engine, tokens)
    return {"tokens": [{"id": t, "piece": _piece(p)} for t, p in zip(tokens, pieces)]}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)  # as llama-server: half a character is shown as its bytes


async def _vllm_tokens(body: Body, env: ApiEnv) -> RenderedChat:
    """vLLM's two /tokenize forms: a chat (`messages`) or a text (`prompt`)."""
    strs = body.get_bool("return_token_strs", False)
    if body.has("messages"):
        call = parse_template_call(body, env)
        body.get_bool("add_special_tokens", False)  # checked; the chat path's own BOS rule decides
        return await chat_prompt(call, env, "tokenizing", pieces=strs)
    prompt = body.raw("prompt")
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string", "prompt")
    add_special = body.get_bool("add_special_tokens", True)  # vLLM's default for a prompt
    async with local_engine(env, _model(body, env), _keep_alive(body), "tokenizing") as engine:
        tokens = await tokenize_async(engine, prompt, add_special=add_special)
        return RenderedChat(prompt, tokens, engine.n_ctx_per_seq, await _pieces(engine, tokens) if strs else None)


def _vllm_answer(rendered: RenderedChat, token_strs: bool) -> dict[str, Any]:
    strs = [p.decode("utf-8", errors="replace") for p in rendered.pieces or []] if token_strs else None
    return {"count": len(rendered.tokens), "max_model_len": rendered.max_model_len, "tokens": rendered.tokens,
            "token_strs": strs}


# --- /detokenize and /apply-template ---------------------------------------------------------------
async def detokenize(body: Body, env: ApiEnv) -> dict[str, str]:
    """`tokens` back to text: `content` as llama-server answers, `prompt` as vLLM does."""
    raw = body.get_list("tokens", max_items=MAX_DETOKENIZE_TOKENS)
    if raw is None:
        raise invalid("'tokens' is required: a list of token ids", "tokens")
    if raw and not is_token_list(raw):
        raise invalid("'tokens' must be a list of integer token ids", "tokens")
    async with local_engine(env, _model(body, env), _keep_alive(body), "detokenizing") as engine:
        tokens = check_tokens(list(raw), engine.info.n_vocab, "tokens")
        pieces = await _pieces(engine, tokens)
    text = b"".join(pieces).decode("utf-8", errors="replace")
    return {"content": text, "prompt": text}


async def apply_template(body: Body, env: ApiEnv) -> dict[str, str]:
    """`{"prompt": ...}`: the conversation as the model's chat template renders it for a chat request."""
    call = parse_template_call(body, env)
    return {"prompt": (await chat_prompt(call, env, "applying the chat template", tokenize=False)).prompt}


def _model(body: Body, env: ApiEnv) -> str:
    return body.get_str("model", None, max_len=512) or env.settings.default_model


def _keep_alive(body: Body) -> float | None:
    return parse_keep_alive(body.raw("keep_alive"))
