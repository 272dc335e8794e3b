"""The engine's ids for an image's positions in a prompt's token list (issue 43).

An image (each of its chunks: a tile, an overview) takes as many positions as its projector gives
it embeddings, and each position one negative id: the chunk's key (from the image's sha256 and
which of its chunks it is: backends/llamacpp/media.py) and the row within it. So the same image
has the same ids in every request, and the prefix cache, which matches ids, reuses its cells; two
different images never share an id. The scheduler reads the ids too: an image chunk's encoding
runs in the step that feeds its first position (batching/encode_charge.py).
"""

from __future__ import annotations

ROW_BITS = 20  # rows per chunk: a million positions, far past any projector's tile
ROW_MASK = (1 << ROW_BITS) - 1


def media_ids(key: int, n: int) -> list[int]:
    """The ids of a chunk's n positions."""
    base = 1 + (key << ROW_BITS)
    return [-(base + row) for row in range(n)]


def chunk_of(token: int) -> int:
    """The chunk key of an image position's id."""
    return (-token - 1) >> ROW_BITS


def row_of(token: int) -> int:
    """Which of its chunk's positions an id is."""
    return (-token - 1) & ROW_MASK
