"""Incremental detokenizer and stop-string matcher."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.batching.text import Detokenizer, StopMatcher


def _run(pieces: list[bytes], stops: list[str]) -> tuple[list[str], bool]:
    table = dict(enumerate(pieces))
    detok = Detokenizer(table.__getitem__, stops)
    deltas = []
    for token in range(len(pieces)):
        delta, stopped = detok.add(token)
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(detok.finish())
    return deltas, False


def test_multibyte_characters_split_across_tokens_are_held_back():
    deltas, stopped = _run([b"caf", b"\xc3", b"\xa9 ", b"\xe2\x82", b"\xac", b"!"], [])
    assert deltas == ["caf", "", "é ", "", "€", "!", ""]
    assert not stopped


def test_stop_string_spanning_tokens_is_never_emitted():
    deltas, stopped = _run([b"Hello", b" Us", b"er", b":", b" more"], ["User:"])
    assert stopped
    assert "".join(deltas) == "Hello "
    assert deltas == ["Hello", " ", "", ""]  # "Us" held until it was known to be the stop


def test_held_prefix_released_when_it_is_not_a_stop():
    deltas, stopped = _run([b"a Us", b"ually", b" fine"], ["User:"])
    assert not stopped
    assert deltas[0] == "a " and "".join(deltas) == "a Usually fine"


def test_earliest_of_several_stop_strings_wins():
    deltas, stopped = _run([b"xx END yy STOP"], ["STOP", "END"])
    assert stopped and "".join(deltas) == "xx "


def test_held_tail_flushed_at_a_non_stop_finish():
    deltas, stopped = _run([b"the end is ne"], ["near"])
    assert not stopped
    assert deltas == ["the end is ", "ne"]


def test_incomplete_character_at_finish_becomes_replacement():
    deltas, _ = _run([b"ok", b"\xe2\x82"], [])
    assert "".join(deltas) == "ok\ufffd"


def test_stop_string_inside_a_multibyte_run():
    deltas, stopped = _run([b"\xc3", b"\xa9t\xc3", b"\xa9"], ["t\u00e9"])
    assert stopped and "".join(deltas) == "é"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab é€\n:", max_size=40),
    stop=st.text(alphabet="ab é€\n:", min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_random_splits_give_the_text_before_the_first_stop(text, stop, seed):
    data = text.encode()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 10)))) if len(data) > 1 else []
    pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
    deltas, stopped = _run(pieces, [stop])
    out = "".join(deltas)
    if stop in text:
        assert stopped and out == text[: text.index(stop)]
    else:
        assert not stopped and out == text
    # Nothing emitted is ever taken back: each prefix of the output is a prefix of the text.
    assert text.startswith(out)


def test_stop_matcher_without_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""
