"""A reasoning budget in each dialect's words, and the engine's part of it (issue 45).

Every dialect names how long a reasoning model may think in its own way: OpenAI's chat
`reasoning_effort` and the Responses API's `reasoning.effort` (levels), Ollama's `think` (true,
false, or a level), Anthropic's `thinking.budget_tokens` and llama-server's `reasoning_budget_tokens`
(tokens; -1 no limit, 0 none). They all come down to one number of thinking tokens, the budget,
after which the engine closes the think block with the model's own end tag and the answer follows
(batching/thinking.py). A level is a budget from EFFORT_BUDGETS (README states it).

Why these figures: a level is a wait, and here it is a consumer machine's wait. At the 20-50
tokens a second a desktop CPU or laptop GPU decodes a 7-8B model at, low (512) is a 10-25 s
thought, medium (2048) under two minutes, high (8192) several; each level four times the one
below, as the wait a user notices grows with it. xhigh (32768) is in effect no limit on a local
context, and none (0) closes the block before a token is spent (and, where the template can,
asks it not to think at all).
"""

from __future__ import annotations

from typing import Any

from ..protocol.engine import ModelEngine
from ..protocol.requests import Thinking
from .templates import THINK_CLOSE, THINK_OPEN, ChatTemplate, is_reasoning_template
from .validation import Body, invalid

EFFORT_BUDGETS: dict[str, int] = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192,
                                  "xhigh": 32768}
OLLAMA_LEVELS = ("low", "medium", "high")  # Ollama's `think` besides true and false; gpt-oss's own levels
MAX_BUDGET = 1 << 24  # more than any context holds; a larger number is a client's mistake

# (open, close) of the think blocks templates write: the <think> tags (Qwen3, DeepSeek-R1 distills,
# QwQ), and gpt-oss's harmony channels, whose analysis channel ends where the final one begins.
_HARMONY = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")


def effort_budget(effort: str | None) -> int | None:
    return EFFORT_BUDGETS[effort] if effort is not None else None


def llamacpp_budget(body: Body) -> int | None:
    """llama-server's per-request `reasoning_budget_tokens` (its `--reasoning-budget` flag's name,
    `reasoning_budget`, too): -1 no limit (None), 0 no thinking, N tokens."""
    name = "reasoning_budget_tokens" if body.has("reasoning_budget_tokens") else "reasoning_budget"
    budget = body.get_int(name, None, lo=-1, hi=MAX_BUDGET)
    return None if budget is None or budget < 0 else budget


def chat_reasoning(body: Body) -> tuple[int | None, dict[str, Any]]:
    """(the budget an OpenAI-dialect chat body asks for: llama-server's token count, else
    `reasoning_effort`'s level; the template variables it sets)."""
    tokens = llamacpp_budget(body)
    effort = body.get_str("reasoning_effort", None, choices=tuple(EFFORT_BUDGETS))
    budget = tokens if tokens is not None else effort_budget(effort)
    variables = think_off(budget)
    if effort in OLLAMA_LEVELS:  # gpt-oss's template writes it into its system prompt ("Reasoning: low")
        variables["reasoning_effort"] = effort
    return budget, variables


def ollama_think(body: Body) -> tuple[bool | None, int | None]:
    """Ollama's `think`: (enable_thinking for the template, or None to leave the template's
    default; the budget)."""
    value = body.raw("think")
    if value is None or isinstance(value, bool):
        return value, None
    if isinstance(value, str) and value in OLLAMA_LEVELS:
        return True, EFFORT_BUDGETS[value]
    raise invalid(f"'think' must be true, false or one of {', '.join(OLLAMA_LEVELS)} (got {str(value)[:40]!r})",
                  "think")


def think_off(budget: int | None) -> dict[str, Any]:
    """Template variables for a budget of 0: a template that can leave thinking out is told to."""
    return {"enable_thinking": False} if budget == 0 else {}


def _tags(template: str) -> tuple[str, str]:
    return _HARMONY if _HARMONY[0] in template else (THINK_OPEN, THINK_CLOSE)


def think_tags(template: str) -> bool:
    """Whether the template's model thinks in `<think>` tags (what reasoning.ThinkSplit reads),
    not in gpt-oss's channels."""
    return _tags(template)[0] == THINK_OPEN


def engine_thinking(engine: ModelEngine, template: ChatTemplate, prompt: str, budget: int | None) -> Thinking | None:
    """The request's Thinking for a rendered prompt: None where the template does not reason or
    closed the block already (thinking off); else the model's tags as its tokens and the budget."""
    if not (is_reasoning_template(template.source) or _HARMONY[0] in template.source):
        return None
    open_tag, close_tag = _tags(template.source)
    tail = prompt.rstrip()
    if tail.endswith(close_tag.rstrip()):
        return None
    start = [] if tail.endswith(open_tag.rstrip()) else list(engine.tokenize(open_tag, add_special=False))
    return Thinking(end=list(engine.tokenize(close_tag, add_special=False)), start=start, budget=budget)
