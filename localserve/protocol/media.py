"""Images (and later audio) inside a prompt: the neutral form every dialect's parser produces and
the engine consumes (issue 43).

A dialect's parser (api/) turns each image part of a message into one ImageInput, checked and
bounded before any model work, and puts one MEDIA_MARKER in the message's text where the image
stood; the chat template renders that text as it renders any other. The engine that holds the
model's projector turns marker + image into the image's embedding positions (llama.cpp's mtmd
library uses the same marker by default, so the rendered prompt goes to it unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIA_MARKER = "<__media__>"  # llama.cpp mtmd's default marker (mtmd_default_marker())


@dataclass(frozen=True)
class ImageInput:
    """One image as the client sent it, already checked: a format the decoder takes, dimensions
    read from its header within the bounds (a decompression bomb never reaches a decoder), bytes
    within the per-request bound. `sha256` keys the prefix cache: two requests with the same image
    share its cells, two different images never do."""

    data: bytes  # the encoded file (PNG, JPEG, GIF, BMP, WebP...), exactly as sent
    sha256: str  # hex digest of data
    width: int
    height: int
    format: str  # "png", "jpeg", ... as the header says
