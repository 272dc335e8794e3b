"""llama.cpp server's native dialect without HTTP: `/infill`, `/completion` and `/props`.

`/infill` is what llama.vscode and llama.vim call: the text around the cursor (`input_prefix`,
`input_suffix`), chunks of other files (`input_extra`: [{"filename", "text"}]), the start of the
middle already typed (`prompt`). `/completion` is the raw-prompt route of Continue's and Tabby's
llama.cpp providers (the client fills its own FIM template). Both take llama.cpp's sampling names
(`n_predict`, `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`, `seed`, `stop`,
`ignore_eos`) and `t_max_predict_ms`, and answer what the plugins read: `content`,
`tokens_cached` (how much of the prompt the prefix cache served: consecutive keystrokes in one
file share their start), `truncated`, `timings` and `stop`. A request's `id_slot` ends the same client's previous request
for that slot (server/slots.py): the editor moved on. `n_predict` 0 is the plugins' warm-up after
an edit: it fills the cache and answers no text (the engine still computes one token, which is
dropped).
`/props` gives `n_ctx` and `total_slots`, which llama.vscode reads to size its context chunks.
`/completion` takes images as llama-server does: `multimodal_data` (base64 strings), in a prompt
object `{"prompt_string", "multimodal_data"}` or beside a string prompt, with one `<__media__>` marker
in the prompt text per image, where it goes (api/images.py checks them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..protocol.engine import EventStream, ModelEngine
from ..protocol.requests import GenerationEvent, GenerationRequest, Lane, SamplingParams, Usage
from .fim import fim_prompt_async, prompt_budget
from ..protocol.media import MEDIA_MARKER
from .generation import check_tokens, is_token_list, tokenize_async
from .images import ImageParts
from .lora import checked_lora, parse_lora
from .validation import Body, check_schema, clamp_max_tokens, invalid, parse_lane, parse_seed, parse_stop, sampling_from

# llama-server checks only input_extra's shape and takes what fits the context. llama.vscode sends
# its ring of recently seen chunks (16 of 64 lines by default); these bounds are far above any
# ring's, and keep one request from holding megabytes of text the context could never show.
MAX_EXTRA_CHUNKS = 256
MAX_EXTRA_CHARS = 1 << 21  # all chunks' names and texts together
MAX_FILENAME_CHARS = 4096  # a path (PATH_MAX)
MAX_PROMPT_TOKENS = 1 << 20


@dataclass
class NativeCall:
    """What /infill and /completion share: the model, sampling, answer length and time bound."""

    body: Body
    model: str
    n_predict: int | None  # None: to the context's end; 0: warm-up
    stream: bool
    priority: str | None
    # llama.cpp's bound on generation time, counted from the first token, that only ends an
    # answer once it holds a newline (a completion cut mid-line is worse than a late one).
    t_max_predict_ms: int | None
    id_slot: int | None = None  # a newer request for it ends this one (server/slots.py)
    truncated: bool = field(default=False, init=False)
    images: ImageParts = field(default_factory=ImageParts)  # /completion's multimodal_data, in order

    @property
    def lane(self) -> Lane:
        return parse_lane(self.body, self.priority, "interactive")  # someone is typing

    def request(self, engine: ModelEngine, tokens: list[int], param: str) -> GenerationRequest:
        sampling = sampling_from(self.body, n_vocab=engine.info.n_vocab, seed=parse_seed(self.body))
        sampling.json_schema = _json_schema(self.body)
        requested = 1 if self.n_predict == 0 else self.n_predict
        return GenerationRequest(
            prompt_tokens=tokens, sampling=sampling,
            max_tokens=clamp_max_tokens(requested, len(tokens), engine.n_ctx_per_seq, param),
            stop=parse_stop(self.body.raw("stop")),
            lane=self.lane,
            ignore_eos=self.body.get_bool("ignore_eos", False),
            speculative=_speculative(self.body),
            lora=checked_lora(parse_lora(self.body, self.model), engine),
        )


def _speculative(body: Body) -> bool:
    """llama-server's per-request `speculative.n_max` (0: no drafts), or our `speculative` flag."""
    n_max = body.get_int("speculative.n_max", None, lo=0, hi=1 << 16)
    return body.get_bool("speculative", True) and n_max != 0


def _json_schema(body: Body) -> dict | None:
    schema = body.raw("json_schema")
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise invalid("'json_schema' must be a JSON schema object", "json_schema")
    check_schema(schema, "json_schema")
    return schema


def _native_fields(body: Body, default_model: str, priority: str | None, default_n_predict: int) -> dict[str, Any]:
    if body.raw("grammar") not in (None, ""):
        raise invalid("'grammar' (GBNF) is not supported; send 'json_schema' instead", "grammar")
    n_predict = body.get_int("n_predict", None, lo=-1, hi=(1 << 31) - 1)
    fields = dict(
        body=body,
        model=body.get_str("model", None, max_len=512) or default_model,
        # Absent or -1: the setting default_max_tokens, as llama-server's -n (0 there: no limit).
        n_predict=(default_n_predict or None) if n_predict is None or n_predict < 0 else n_predict,
        stream=body.get_bool("stream", False),
        priority=priority,
        t_max_predict_ms=body.get_int("t_max_predict_ms", None, lo=0, hi=1 << 31) or None,
        id_slot=_id_slot(body),
    )
    sampling_from(body, n_vocab=None, seed=parse_seed(body))  # bad sampling fields fail before a load
    _speculative(body)
    parse_stop(body.raw("stop"))
    _json_schema(body)
    parse_lora(body, fields["model"])
    return fields


def _id_slot(body: Body) -> int | None:
    slot = body.get_int("id_slot", None, lo=-1, hi=(1 << 31) - 1)
    return None if slot is None or slot < 0 else slot  # -1: llama-server's "any slot"


@dataclass
class InfillCall(NativeCall):
    prefix: str = ""
    suffix: str = ""
    middle: str = ""
    extra: list[tuple[str, str]] = field(default_factory=list)

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        fim = await fim_prompt_async(engine, self.model, self.prefix, self.suffix,
                                     budget=prompt_budget(engine, self.n_predict), param="input_suffix",
                                     extra=self.extra, middle=self.middle)
        self.truncated = fim.truncated
        return [self.request(engine, fim.tokens, "input_prefix")]


def parse_infill(body: Body, default_model: str, priority: str | None, *, default_n_predict: int = 0,
                 images: ImageParts | None = None) -> InfillCall:
    """`images` is taken for the routes' sake and stays empty: /infill reads no images."""
    return InfillCall(**_native_fields(body, default_model, priority, default_n_predict),
                      prefix=body.get_str("input_prefix", "") or "",
                      suffix=body.get_str("input_suffix", "") or "",
                      middle=body.get_str("prompt", "") or "",
                      extra=_input_extra(body))


def _input_extra(body: Body) -> list[tuple[str, str]]:
    """`input_extra` as (filename, text) pairs, refused (400) past its bounds before any work."""
    extra = []
    chars = 0
    for i, chunk in enumerate(body.get_list("input_extra", max_items=MAX_EXTRA_CHUNKS) or []):
        if not isinstance(chunk, dict):
            raise invalid("'input_extra' items must be objects with 'filename' and 'text'", f"input_extra[{i}]")
        item = Body(chunk, f"input_extra[{i}].")
        filename = item.get_str("filename", "", max_len=MAX_FILENAME_CHARS) or ""
        text = item.get_str("text", "", max_len=MAX_EXTRA_CHARS) or ""
        chars += len(filename) + len(text)
        if chars > MAX_EXTRA_CHARS:
            raise invalid(f"'input_extra' holds more than {MAX_EXTRA_CHARS} characters in all; the context shows "
                          "only the chunks nearest the end that fit", "input_extra")
        extra.append((filename, text))
    return extra


@dataclass
class CompletionCall(NativeCall):
    prompt: str | list[int] = ""
    return_tokens: bool = False

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        images = self.images.for_model(engine)
        if isinstance(self.prompt, list):
            tokens = check_tokens(self.prompt, engine.info.n_vocab, "prompt")
        else:
            # llama-server tokenizes /completion prompts with BOS and special tokens parsed, so a
            # client-side FIM template (`<|fim_prefix|>...`) reaches the model as its tokens.
            tokens = await tokenize_async(engine, self.prompt, images=images)
        request = self.request(engine, tokens, "prompt")
        request.images = images
        return [request]


def _multimodal_prompt(body: Body, images: ImageParts) -> Any:
    """The prompt with its `multimodal_data` taken into `images`: llama-server's prompt object
    {"prompt_string", "multimodal_data"}, or a string prompt with the list beside it."""
    raw = body.raw("prompt")
    if isinstance(raw, dict):
        inner = Body(raw, "prompt.")
        raw = inner.get_str("prompt_string", None)
        if raw is None:
            raise invalid("'prompt.prompt_string' is required in a prompt object", "prompt.prompt_string")
        data, param = inner.get_list("multimodal_data", max_items=1 << 10), "prompt.multimodal_data"
    else:
        data, param = body.get_list("multimodal_data", max_items=1 << 10), "multimodal_data"
    if not data:
        return raw
    if not isinstance(raw, str):
        raise invalid(f"'{param}' needs a text prompt holding one {MEDIA_MARKER!r} per item", param)
    for j, item in enumerate(data):
        images.add_base64(item, f"{param}[{j}]", audio_too=True)
    if raw.count(MEDIA_MARKER) != len(data):
        raise invalid(f"'prompt' holds {raw.count(MEDIA_MARKER)} {MEDIA_MARKER!r} markers for {len(data)} "
                      f"'{param}' items: put one marker where each image goes", "prompt")
    return raw


def parse_native_completion(body: Body, default_model: str, priority: str | None, *,
                            default_n_predict: int = 0, images: ImageParts | None = None) -> CompletionCall:
    images = images if images is not None else ImageParts()
    raw = _multimodal_prompt(body, images)
    if isinstance(raw, str):
        prompt: str | list[int] = raw
    elif isinstance(raw, list) and raw and is_token_list(raw):
        if len(raw) > MAX_PROMPT_TOKENS:
            raise invalid(f"'prompt' has more than {MAX_PROMPT_TOKENS} tokens", "prompt")
        prompt = list(raw)
    else:
        raise invalid("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    return CompletionCall(**_native_fields(body, default_model, priority, default_n_predict), prompt=prompt,
                          return_tokens=body.get_bool("return_tokens", False), images=images)


async def bounded(stream: EventStream, call: NativeCall) -> AsyncIterator[GenerationEvent]:
    """The stream's events, ended once generation passed `t_max_predict_ms` with a newline in it:
    the stream is cancelled (its cells free at the next step) and its last event, "cancelled" by
    us, says "length", as llama-server's stop_type "limit"."""
    limit_s = call.t_max_predict_ms / 1000 if call.t_max_predict_ms else None
    first: float | None = None
    newline = expired = False
    async for event in stream:
        if expired and event.finish_reason == "cancelled":
            event.finish_reason = "length"
        yield event
        if limit_s is None or event.finish_reason is not None or expired:
            continue
        if event.token_ids and first is None:
            first = time.monotonic()
        newline = newline or "\n" in event.text
        if first is not None and newline and time.monotonic() - first >= limit_s:
            expired = True
            stream.cancel()


def stop_type(reason: str | None) -> str:
    return {"stop": "eos", "length": "limit"}.get(reason or "", "none")


def final_object(call: NativeCall, model: str, text: str, tokens: list[int], usage: Usage | None,
                 reason: str | None) -> dict[str, Any]:
    """The last object: the answer's text (empty for a warm-up) and what the plugins read about it."""
    prompt_n = usage.prompt_tokens if usage else 0
    predicted_n = 0 if call.n_predict == 0 else (usage.completion_tokens if usage else 0)
    prompt_ms = max(0.0, (usage.ttft_s - usage.queue_s) * 1000) if usage else 0.0
    predicted_ms = max(0.0, (usage.total_s - usage.ttft_s) * 1000) if usage else 0.0
    cached = usage.cached_tokens if usage else 0
    out: dict[str, Any] = {
        "content": "" if call.n_predict == 0 else text,
        "model": model, "stop": True, "stop_type": stop_type(reason),
        "tokens_predicted": predicted_n,
        "tokens_evaluated": prompt_n, "tokens_cached": cached, "truncated": call.truncated,
        "timings": {
            "prompt_n": prompt_n - cached, "prompt_ms": round(prompt_ms, 3), "cache_n": cached,
            "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(predicted_n / (predicted_ms / 1000), 2) if predicted_ms > 0 else 0.0,
        },
    }
    if isinstance(call, CompletionCall):
        out["prompt"] = call.prompt
        if call.return_tokens:
            out["tokens"] = [] if call.n_predict == 0 else tokens
    return out


def chunk_object(call: NativeCall, text: str, tokens: list[int]) -> dict[str, Any]:
    """One streamed piece: `data: {"content": ..., "stop": false}`."""
    out: dict[str, Any] = {"content": text, "stop": False}
    if isinstance(call, CompletionCall) and call.return_tokens:
        out["tokens"] = tokens
    return out


def props_body(model: str, context: int, slots: int, version: str, n_predict: int = 0, *,
               vision: bool = False, audio: bool = False) -> dict[str, Any]:
    """GET /props: the served context and slots, the defaults a request gets (`n_predict`: the
    setting default_max_tokens, -1 for none, as llama-server shows its -n), whether it takes
    images and audio (`modalities`, as llama-server says it), no filesystem path."""
    d = SamplingParams()
    return {
        "default_generation_settings": {
            "n_ctx": context,
            "params": {"n_predict": n_predict or -1, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                       "min_p": d.min_p, "repeat_penalty": d.repeat_penalty},
        },
        "total_slots": slots,
        "model_alias": model,
        "model_path": model,  # llama-server gives the file's path; a model name tells a client as much
        "modalities": {"vision": vision, "audio": audio},
        "build_info": f"localserve {version}",
    }
