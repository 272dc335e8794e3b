"""api/chat_history.py: which turns a chat over its context loses (Ollama's rule, plus a kept
history that starts at a user turn), with a tokenizer that counts one token per character."""

from __future__ import annotations

import asyncio

from localserve.api.chat_history import answer_room, fit_history


def fit(messages):
    async def count(ms):
        return [0] * sum(len(m["content"]) for m in ms)
    return asyncio.run(fit_history(messages, count, 30))


def test_a_chat_that_fits_is_untouched():
    messages = [{"role": "user", "content": "x" * 30}]
    tokens, dropped = fit(messages)
    assert (len(tokens), dropped) == (30, 0)


def test_oldest_turns_go_system_messages_and_the_latest_stay():
    messages = [{"role": "system", "content": "s" * 5},
                {"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
                {"role": "user", "content": "c" * 5}, {"role": "tool", "content": "d" * 5},
                {"role": "system", "content": "e" * 5}, {"role": "user", "content": "f" * 10}]
    tokens, dropped = fit(messages)
    # Dropping a, b fits (5 + 5 + 5 + 5 + 10 = 30): the first kept non-system turn, c, is a user's.
    assert (len(tokens), dropped) == (30, 2)


def test_a_kept_history_does_not_start_with_a_tool_result_or_an_answer():
    messages = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 3},
                {"role": "tool", "content": "c" * 3}, {"role": "user", "content": "d" * 10},
                {"role": "user", "content": "e" * 10}]
    tokens, dropped = fit(messages)
    assert (len(tokens), dropped) == (20, 3)  # "a" alone would fit (26), but b and c would lead


def test_the_latest_message_alone_over_the_budget_is_left_to_the_context_check():
    messages = [{"role": "system", "content": "s" * 5}, {"role": "user", "content": "a" * 10},
                {"role": "user", "content": "z" * 40}]
    tokens, dropped = fit(messages)
    assert (len(tokens), dropped) == (45, 1)


def test_answer_room():
    assert answer_room(2048, None) == 512 and answer_room(2048, 8) == 8 and answer_room(2048, 10_000) == 512
