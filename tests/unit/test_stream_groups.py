"""How the llama.cpp backend splits a step's batch into llama_decode calls (llamacpp_batch.stream_groups)."""

from __future__ import annotations

import numpy as np

from localserve.backends.llamacpp.batch import media_calls, stream_groups


def groups(seq: list[int]):
    out = stream_groups(np.array(seq, dtype=np.int32))
    return None if out is None else [g.tolist() for g in out]


def test_decodes_in_ascending_ids_go_as_they_are():
    assert groups([0, 1, 2, 5]) is None
    assert groups([3]) is None


def test_decodes_out_of_order_are_sorted_by_id():
    assert groups([2, 0, 1]) == [[1, 2, 0]]


def test_one_prompt_chunk_alone_goes_as_it_is():
    assert groups([4, 4, 4]) is None


def test_each_prompt_chunk_gets_its_own_call_and_decodes_go_last():
    # rows: seq 3 decode, seq 1 chunk (rows 1-3), seq 0 decode, seq 2 chunk (rows 5-6)
    assert groups([3, 1, 1, 1, 0, 2, 2]) == [[1, 2, 3], [5, 6], [4, 0]]


def test_every_row_is_submitted_exactly_once():
    rng = np.random.default_rng(0)
    for _ in range(200):
        seq = rng.integers(0, 8, size=int(rng.integers(1, 40))).astype(np.int32)
        out = stream_groups(seq)
        rows = np.arange(len(seq)) if out is None else np.concatenate(out)
        assert sorted(rows.tolist()) == list(range(len(seq)))
        for g in out or []:
            ids = seq[g]
            assert len(set(ids.tolist())) == 1 or len(ids) == len(set(ids.tolist()))  # one chunk, or decodes


def test_image_rows_get_calls_of_their_own_in_position_order():
    """llama_decode takes tokens or embeddings: a chunk of text, image, text is three calls, in that
    order, and a decoding sequence's row still goes last (media_calls)."""
    seq = np.array([0, 0, 0, 0, 0, 0, 0, 1], dtype=np.int32)
    media = np.array([False, False, True, True, True, False, False, False])
    calls = media_calls(stream_groups(seq), len(seq), media)
    assert [c.tolist() for c in calls] == [[0, 1], [2, 3, 4], [5, 6], [7]]
    # One pool (no stream groups): the same cuts, over the batch as it is.
    assert [c.tolist() for c in media_calls(None, len(seq), media)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
