"""What an image's encoding costs the step that runs it, in the scheduler's unit: prompt tokens.

An image chunk (protocol/media_ids.py) is encoded (the projector's vision tower) in the step whose
batch holds its first position, on the engine thread before that step's decode. So that step is
charged for it, as for as many prompt tokens as the chunk has positions (the tower's work grows
with the patches those positions come from), and a prompt chunk that would start an image in a
step with too little room left stops short of it instead: the image then starts a later step
where it comes first, and running decodes never wait for an encode plus a whole prompt chunk.
A prompt alone in its step is never cut for it: nothing waits on that step but the prompt itself.
"""

from __future__ import annotations

from typing import Sequence

from ..backends.base import Capabilities
from ..protocol.media_ids import chunk_of, row_of


def encode_charge(tokens: Sequence[int], start: int, n: int) -> tuple[int, int]:
    """(the positions of the image chunks whose first position is in tokens[start:start+n], the
    index of the first such position or -1)."""
    if n <= 0 or min(tokens[start:start + n]) >= 0:  # no image: one C-level pass
        return 0, -1
    charge, first = 0, -1
    for p in range(start, start + n):
        token = tokens[p]
        if token < 0 and row_of(token) == 0:
            first = p if first < 0 else first
            charge += _chunk_length(tokens, p)
    return charge, first


def before_encode(caps: Capabilities, tokens: Sequence[int], start: int, want: int, room: int) -> int:
    """`want` prompt tokens from `start`, or fewer where they would start an image's encode in a
    step without room for it: up to the image when at least a chunk comes before it, else the
    image's start with what room its encode leaves."""
    charge, first = encode_charge(tokens, start, want)
    if not charge or want + charge <= room:
        return want
    pending = len(tokens) - start
    before = first - start
    if before >= caps.min_chunk:
        return caps.chunk(pending, before) or want
    return caps.chunk(pending, max(caps.min_chunk, room - charge)) or want


def _chunk_length(tokens: Sequence[int], p: int) -> int:
    key = chunk_of(tokens[p])
    end = p
    while end < len(tokens) and tokens[end] < 0 and chunk_of(tokens[end]) == key:
        end += 1
    return end - p
