"""Our sampling fields -> onnxruntime-genai's per-turn options, and clear refusals for the rest.

og.TurnOptions (0.18) offers temperature, top-k, top-p, seed, repetition penalty, a minimum length
and grammars (JSON schemas ran here through its guidance). What it cannot do is refused with a 400
naming the field, never silently ignored: min-p, frequency/presence penalties, logit_bias,
logprobs, GBNF grammars (OGA's guidance takes JSON schemas, regexes and Lark, not GBNF), and a seed
on an engine without dynamic batching (all CPU folders). The server fills unset fields with SamplingParams'
defaults and cannot tell them from fields the client sent, so a field at its default counts as
unset: min_p 0.05 is then not applied, and OGA's repetition penalty (which covers the whole
sequence, llama.cpp's penalty_last_n -1) is used with the default window as well.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import InvalidRequestError
from ...protocol.requests import GenerationRequest, SamplingParams

_DEFAULTS = SamplingParams()


def check_supported(sampling: SamplingParams, constraints: bool, seeds: bool) -> None:
    """InvalidRequestError naming the first field OGA cannot honour. `constraints`: whether this
    onnxruntime-genai build has guidance (JSON schemas); `seeds`: whether the engine takes per-request
    seeds (0.18 takes them only with dynamic batching: "A per-turn seed requires an Engine configured
    for dynamic batching", measured on the CPU EP's static engine)."""
    def refuse(param: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"'{param}' is not supported by onnxruntime-genai models ({why})", param=param)

    if sampling.min_p not in (0.0, _DEFAULTS.min_p):
        raise refuse("min_p", "its sampler has no min-p; use top_p or top_k")
    if sampling.frequency_penalty or sampling.presence_penalty:
        raise refuse("frequency_penalty" if sampling.frequency_penalty else "presence_penalty",
                     "its sampler has only repeat_penalty")
    if sampling.repeat_penalty != 1.0 and sampling.penalty_last_n not in (-1, _DEFAULTS.penalty_last_n):
        raise refuse("penalty_last_n", "its repetition penalty always covers the whole sequence (-1)")
    if sampling.seed is not None and not sampling.greedy and not seeds:
        raise refuse("seed", "its static-batching engine takes no per-request seed; greedy requests need none")
    if sampling.logit_bias:
        raise refuse("logit_bias", "its engine exposes no logits")
    if sampling.logprobs is not None:
        raise refuse("logprobs", "its engine returns tokens only")
    if sampling.grammar is not None:
        raise refuse("grammar", "it takes JSON schemas, not GBNF grammars")
    if sampling.json_schema is not None and not constraints:
        raise refuse(sampling.constraint_param, "this onnxruntime-genai build has no guidance support")


def turn_options(og: Any, og_request: Any, request: GenerationRequest) -> Any:
    """The og.TurnOptions of `request` (checked by check_supported first)."""
    s = request.sampling
    opts = og.TurnOptions(og_request)
    opts.set_max_generated_tokens(request.max_tokens)
    if request.ignore_eos:
        opts.set_min_generated_tokens(request.max_tokens)  # OGA masks EOS until then
    if s.greedy:
        opts.set_do_sample(False)
    else:
        opts.set_do_sample(True)
        opts.set_temperature(s.temperature)
        opts.set_top_k(s.top_k)  # 0 = off, as ours
        opts.set_top_p(s.top_p)
    if s.seed is not None and not s.greedy:
        opts.set_seed(s.seed)
    if s.repeat_penalty != 1.0:
        opts.set_repetition_penalty(s.repeat_penalty)
    if s.json_schema is not None:
        opts.set_guidance("json_schema", json.dumps(s.json_schema or {"type": "object"}))
    return opts
