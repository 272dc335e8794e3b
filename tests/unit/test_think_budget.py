"""Reasoning budgets in the engine (batching/thinking.py, Sequence.append): the think block's
tokens counted, a spent budget closed with the model's own end tokens in place of the next sample,
with speculative decoding on as off. The dialects' fields and the real model are
tests/model/test_reasoning_budget.py's."""

from __future__ import annotations

import random

import pytest

from localserve.batching.thinking import ThinkCounter
from localserve.errors import InvalidRequestError
from localserve.protocol.requests import GenerationRequest, Thinking, check_request
from fake_backend import FakeBackend
from scheduler_harness import Harness

END = [61, 62]  # a two-token end tag, as `</think>` is in SmolLM2's vocabulary


def seen(counter: ThinkCounter, tokens: list[int]) -> ThinkCounter:
    for token in tokens:
        counter.see(token)
    return counter


def test_the_block_opened_by_the_answer_or_the_prompt_is_counted_without_its_tags():
    assert seen(ThinkCounter(Thinking(end=END, start=[7, 8])), [7, 8, 1, 2, 3, 61, 62, 4]).tokens == 3
    inside = seen(ThinkCounter(Thinking(end=END)), [1, 2, 61, 62, 5, 6])
    assert inside.tokens == 2 and inside.state == "answer"
    # An answer that does not begin with the open tag has no think block at all.
    plain = seen(ThinkCounter(Thinking(end=END, start=[7, 8])), [7, 9, 1, 2, 3])
    assert plain.tokens == 0 and plain.state == "answer"
    # A tag cut short is thinking like any other text.
    assert seen(ThinkCounter(Thinking(end=END)), [1, 61, 2]).tokens == 3


def test_the_budget_is_due_once_spent_and_the_close_is_the_end_tag():
    counter = seen(ThinkCounter(Thinking(end=END, budget=2)), [1])
    assert not counter.due
    counter.see(2)
    assert counter.due and counter.close() == END and counter.state == "answer" and not counter.due
    assert ThinkCounter(Thinking(end=END, budget=0)).due  # closed before a token is spent
    assert not seen(ThinkCounter(Thinking(end=END)), list(range(1, 50))).due  # no budget: no end


def copying_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(1, 60) for _ in range(rng.randrange(6, 20))]
    return (motif * 5)[:40]


def budgeted(mode: str, budgets: list[int | None], max_tokens: int = 40):
    h = Harness(FakeBackend(copying=True), speculative=mode)
    results = [h.submit(copying_prompt(i), max_tokens=max_tokens, thinking=Thinking(end=END, budget=b))
               for i, b in enumerate(budgets)]
    h.run()  # the books are checked against the cache after every step
    h.assert_drained()
    return results, h.sched.drafts


@pytest.mark.parametrize("mode", ["off", "ngram"])
def test_a_spent_budget_puts_the_end_tag_in_place_of_the_next_token(mode):
    budgets = [0, 1, 5, 17, None]
    plain, _ = budgeted("off", [None] * len(budgets))
    results, drafts = budgeted(mode, budgets)
    for budget, r, free in zip(budgets, results, plain):
        if budget is None:
            assert r.tokens == free.tokens and r.usage.reasoning_tokens == 40
            continue
        # Thinking is the model's own up to the budget, then its end tag, then it goes on.
        assert r.tokens[:budget] == free.tokens[:budget], budget
        assert r.tokens[budget:budget + len(END)] == END and len(r.tokens) == 40
        assert r.usage.reasoning_tokens == budget and r.usage.completion_tokens == 40
    if mode == "ngram":
        assert sum(drafts.accepted.values()) > 0  # drafts were verified around the forced tags


def test_drafted_and_plain_budgeted_answers_agree():
    budgets = [3, 9, 25]
    plain, _ = budgeted("off", budgets)
    drafted, drafts = budgeted("ngram", budgets)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert sum(drafts.drafted.values()) > 0


def test_a_negative_budget_or_an_end_tag_outside_the_vocabulary_is_refused():
    for thinking in (Thinking(end=END, budget=-1), Thinking(end=[]), Thinking(end=[99])):
        with pytest.raises(InvalidRequestError):
            check_request(GenerationRequest(prompt_tokens=[1, 2], thinking=thinking), 64, 64)


def test_a_forced_end_tag_holding_an_end_of_generation_token_ends_only_the_thinking():
    """gpt-oss closes its analysis channel with <|end|>, one of its end-of-generation tokens."""
    h = Harness(FakeBackend(copying=True))
    r = h.submit(copying_prompt(1), max_tokens=12, thinking=Thinking(end=[0, 62], budget=3))  # 0: the fake's EOG
    h.run()
    assert r.tokens[3:5] == [0, 62] and r.finish_reason == "length" and len(r.tokens) == 12


def test_ollama_lines_carry_the_thought_apart_only_when_think_was_set():
    from localserve.api.generation import Clock
    from localserve.api.ollama_chat import ChatAnswer, parse_chat
    from localserve.api.validation import Body
    from localserve.protocol.requests import GenerationEvent

    def lines(think_inside):
        call = parse_chat(Body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "think": True}), None, 0)
        call.think_inside = think_inside  # as prepare sets it where the prompt opened the block
        answer = ChatAnswer(call, "m", None, Clock())
        events = [GenerationEvent(text="Hmm, a gree"), GenerationEvent(text="ting.</th"),
                  GenerationEvent(text="ink>\n\nHello!", finish_reason="stop")]
        return [line["message"] for line in map(answer.line, events) if line]

    assert lines(True) == [{"role": "assistant", "content": "", "thinking": "Hmm, a gree"},
                           {"role": "assistant", "content": "", "thinking": "ting."},
                           {"role": "assistant", "content": "Hello!"}]
    assert "".join(m["content"] for m in lines(None)) == "Hmm, a greeting.</think>\n\nHello!"


def test_bad_think_values_are_refused_before_any_model():
    from localserve.api.ollama_chat import parse_chat
    from localserve.api.validation import Body

    for value in ("extreme", 3, ["low"]):
        with pytest.raises(InvalidRequestError, match="'think'"):
            parse_chat(Body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "think": value}), None, 0)
