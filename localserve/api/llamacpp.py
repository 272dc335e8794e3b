"""llama.cpp server's native dialect without HTTP: `/infill`, as llama.vscode and llama.vim call it.

A request names the text around the cursor (`input_prefix`, `input_suffix`), chunks of other files
(`input_extra`: [{"filename", "text"}]), the start of the middle already typed (`prompt`) and
llama.cpp's sampling names (`n_predict`, `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`,
`seed`, `stop`). The answer carries what the plugins read: `content`, `tokens_cached` (how much of
the prompt the prefix cache served: consecutive keystrokes in one file share their start),
`truncated`, `timings` and `stop`. `n_predict` 0 is the plugins' warm-up after an edit: it fills the
cache and answers no text (the engine still computes one token, which is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.engine import ModelEngine
from ..protocol.requests import GenerationRequest, Lane, Usage
from .fim import fim_prompt, prompt_budget
from .validation import Body, clamp_max_tokens, invalid, parse_lane, parse_seed, parse_stop, sampling_from

MAX_EXTRA_CHUNKS = 256


@dataclass
class InfillCall:
    body: Body
    model: str
    prefix: str
    suffix: str
    middle: str
    extra: list[tuple[str, str]]
    n_predict: int | None  # None: to the context's end; 0: warm-up
    stream: bool
    priority: str | None
    truncated: bool = field(default=False, init=False)

    @property
    def lane(self) -> Lane:
        return parse_lane(self.body, self.priority, "interactive")  # someone is typing

    async def prepare(self, engine: ModelEngine) -> list[GenerationRequest]:
        n_ctx = engine.n_ctx_per_seq
        fim = fim_prompt(engine, self.model, self.prefix, self.suffix, budget=prompt_budget(engine, self.n_predict),
                         param="input_suffix", extra=self.extra, middle=self.middle)
        self.truncated = fim.truncated
        requested = 1 if self.n_predict == 0 else self.n_predict
        sampling = sampling_from(self.body, n_vocab=engine.info.n_vocab, seed=parse_seed(self.body))
        return [GenerationRequest(
            prompt_tokens=fim.tokens, sampling=sampling,
            max_tokens=clamp_max_tokens(requested, len(fim.tokens), n_ctx, "input_prefix"),
            stop=parse_stop(self.body.raw("stop")),
            lane=self.lane,
        )]


def parse_infill(body: Body, default_model: str, priority: str | None) -> InfillCall:
    extra = []
    for i, chunk in enumerate(body.get_list("input_extra", max_items=MAX_EXTRA_CHUNKS) or []):
        if not isinstance(chunk, dict):
            raise invalid("'input_extra' items must be objects with 'filename' and 'text'", f"input_extra[{i}]")
        item = Body(chunk, f"input_extra[{i}].")
        extra.append((item.get_str("filename", "") or "", item.get_str("text", "") or ""))
    n_predict = body.get_int("n_predict", None, lo=-1, hi=(1 << 31) - 1)
    call = InfillCall(
        body=body,
        model=body.get_str("model", None, max_len=512) or default_model,
        prefix=body.get_str("input_prefix", "") or "",
        suffix=body.get_str("input_suffix", "") or "",
        middle=body.get_str("prompt", "") or "",
        extra=extra,
        n_predict=None if n_predict is None or n_predict < 0 else n_predict,
        stream=body.get_bool("stream", False),
        priority=priority,
    )
    sampling_from(body, n_vocab=None, seed=parse_seed(body))  # bad sampling fields fail before a load
    parse_stop(body.raw("stop"))
    return call


def stop_type(reason: str | None) -> str:
    return {"stop": "eos", "length": "limit"}.get(reason or "", "none")


def infill_final(call: InfillCall, model: str, text: str, usage: Usage | None, reason: str | None) -> dict[str, Any]:
    """The last object: the answer's text (empty for a warm-up) and what the plugins read about it."""
    prompt_n = usage.prompt_tokens if usage else 0
    predicted_n = usage.completion_tokens if usage else 0
    prompt_ms = max(0.0, (usage.ttft_s - usage.queue_s) * 1000) if usage else 0.0
    predicted_ms = max(0.0, (usage.total_s - usage.ttft_s) * 1000) if usage else 0.0
    cached = usage.cached_tokens if usage else 0
    return {
        "content": "" if call.n_predict == 0 else text,
        "model": model, "stop": True, "stop_type": stop_type(reason),
        "tokens_predicted": 0 if call.n_predict == 0 else predicted_n,
        "tokens_evaluated": prompt_n, "tokens_cached": cached, "truncated": call.truncated,
        "timings": {
            "prompt_n": prompt_n - cached, "prompt_ms": round(prompt_ms, 3), "cache_n": cached,
            "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(predicted_n / (predicted_ms / 1000), 2) if predicted_ms > 0 else 0.0,
        },
    }
