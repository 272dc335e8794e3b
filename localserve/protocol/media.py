"""Images and audio clips inside a prompt: the neutral form every dialect's parser produces and
the engine consumes (issue 43).

A dialect's parser (api/) turns each image or audio part of a message into one ImageInput or
AudioInput, checked and bounded before any model work, and puts one MEDIA_MARKER in the message's
text where it stood; the chat template renders that text as it renders any other. The engine that
holds the model's projector turns marker + file into its embedding positions (llama.cpp's mtmd
library uses the same marker by default, so the rendered prompt goes to it unchanged, and it tells
an audio file from an image by its bytes).
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


@dataclass(frozen=True)
class AudioInput:
    """One audio clip as the client sent it, already checked: WAV or MP3, whole (no truncated
    frames), its length read from its header or frames within the bounds. `sha256` keys the prefix
    cache as an image's does."""

    data: bytes  # the encoded file, exactly as sent
    sha256: str  # hex digest of data
    seconds: float
    format: str  # "wav" or "mp3"


# What a prompt's MEDIA_MARKERs stand for, in order.
MediaInput = ImageInput | AudioInput
