"""A chat longer than its context, cut as Ollama cuts it: the oldest turns go, system messages and
the latest message stay. Chat UIs (Open WebUI over its Ollama connection, and the plugins that
keep a whole conversation) rely on it: they send every turn and leave the fitting to the server,
so a conversation that outgrew the context was a 400 here where Ollama answers it.

Beyond Ollama, the kept history starts at a user turn: a tool result or an assistant turn whose
question was cut away makes templates that check the order of roles refuse the messages.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

Messages = list[dict[str, Any]]
TokensOf = Callable[[Messages], Awaitable[list[int]]]


async def fit_history(messages: Messages, tokens_of: TokensOf, budget: int) -> tuple[list[int], int]:
    """(prompt tokens, messages dropped): all of `messages` when their prompt has at most `budget`
    tokens, else the fewest oldest turns dropped for it to fit (found by bisection: a render and
    a tokenize per try). When even the system messages and the latest message do not fit, those
    alone: the caller's context check then refuses the request as before."""
    tokens = await tokens_of(messages)
    if len(tokens) <= budget:
        return tokens, 0
    droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
    best: tuple[list[int], int] | None = None
    lo, hi = 1, len(droppable)
    while lo <= hi:
        k = (lo + hi) // 2
        dropped = _to_a_user_turn(messages, droppable, k)
        tokens = await tokens_of(_without(messages, droppable[:dropped]))
        if len(tokens) <= budget:
            best, hi = (tokens, dropped), k - 1
        else:
            lo = k + 1
    if best is None:
        return await tokens_of(_without(messages, droppable)), len(droppable)
    return best


def _to_a_user_turn(messages: Messages, droppable: list[int], k: int) -> int:
    """`k`, or more, so that the first turn kept is a user's (or nothing droppable is left)."""
    while k < len(droppable) and messages[droppable[k]]["role"] != "user":
        k += 1
    return k


def _without(messages: Messages, drop: list[int]) -> Messages:
    gone = set(drop)
    return [m for i, m in enumerate(messages) if i not in gone]


def answer_room(n_ctx: int, asked: int | None) -> int:
    """Tokens a cut history leaves for the answer: what the request asks for, at most a quarter of
    the context (a quarter when it asks for none), so a cut chat is never answered in one token nor
    cut to nothing for an answer asking for the whole context."""
    quarter = max(1, n_ctx // 4)
    return min(asked, quarter) if asked else quarter
