"""An image's encoding counts in the step budget (batching/encode_charge.py): the step that feeds an
image chunk's first position runs its encode, and is charged for it as for the chunk's positions."""

from __future__ import annotations

from localserve.batching.encode_charge import encode_charge
from localserve.protocol.media_ids import chunk_of, media_ids, row_of

from test_step_plan import STREAMS, planner, positions, step, submit

IMAGE = media_ids(12345, 40)
OTHER = media_ids(777, 8)
PROMPT = list(range(100, 110)) + IMAGE + list(range(200, 210))  # 10 text, 40 image, 10 text


def test_ids_hold_their_chunk_and_row():
    assert all(t < 0 for t in IMAGE)
    assert {chunk_of(t) for t in IMAGE} == {12345}
    assert [row_of(t) for t in IMAGE] == list(range(40))
    assert not set(IMAGE) & set(OTHER)


def test_the_charge_is_the_chunks_positions_where_its_first_one_is_fed():
    assert encode_charge(PROMPT, 0, 10) == (0, -1)  # text only
    assert encode_charge(PROMPT, 0, 11) == (40, 10)  # the image's first position: its encode runs
    assert encode_charge(PROMPT, 11, 30) == (0, -1)  # the rest of an encoded image costs its rows only
    two = IMAGE + OTHER
    assert encode_charge(two, 0, len(two)) == (48, 0)


def test_a_prompt_stops_short_of_an_image_without_room_then_starts_it_with_what_its_encode_leaves():
    sched = planner(STREAMS)  # a 64-token step
    chat = submit(sched, list(range(300, 310)), max_tokens=30)
    step(sched)  # the chat's prompt: it decodes from now on, one token per step
    seq = submit(sched, PROMPT)
    first = step(sched)
    assert positions(first, seq) == list(range(10))  # 10 + the image's 40 + encode 40 > 63 left
    second = step(sched)
    # The image starts here; its encode takes 40 of the 63: 23 of its rows ride along.
    assert positions(second, seq) == list(range(10, 33))
    assert positions(second, chat) != []  # the decoder is never left out for it
    third = step(sched)
    assert positions(third, seq) == list(range(33, 60))  # the rest: rows and text, no encode


def test_an_image_that_fits_with_its_encode_goes_at_once():
    sched = planner(STREAMS)
    seq = submit(sched, list(range(100, 104)) + OTHER + list(range(200, 204)))
    assert positions(step(sched), seq) == list(range(16))  # 16 + 8 for the encode <= 64


def test_alone_an_image_goes_with_its_encode_in_one_step():
    sched = planner(STREAMS)
    seq = submit(sched, PROMPT)  # 60 positions + a 40-position encode: over the 64, but nothing waits
    assert positions(step(sched), seq) == list(range(60))
