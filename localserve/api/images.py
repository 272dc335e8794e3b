"""The one image path behind every dialect (issue 43): a request's image parts, and its audio clips,
collected while its body is parsed, fetched and checked before any model is loaded for it, and
handed to a model whose projector sees (or hears), or refused naming the model.

Each dialect's parser only maps its shape onto `ImageParts`: an OpenAI `image_url` or Responses
`input_image` URL (`add_url`: a `data:` URL or an https link), an Anthropic `image` block or an
Ollama / llama.cpp base64 string (`add_base64`). Each call returns the MEDIA_MARKER the parser
puts in the message's text where the image stood, so the chat template renders plain text and the
engine finds each image at its marker (protocol/media.py). An OpenAI `input_audio` part (chat and
Responses) is `add_audio`: base64 WAV or MP3, checked by api/audio_checks.py; llama.cpp's
`multimodal_data` may hold either, told apart by the decoded bytes (`add_base64(..., audio_too=True)`).

Three moments, each a 400 naming the field before the engine sees anything:
- parsing (`add_*`, on the event loop, cheap): the part's shape, a data URL's media type, the
  URL's scheme and host under /api/pull's policy, how many images (`max_images_per_request`);
- `resolve()`, before the model is loaded (generation() calls it), in a worker thread: base64
  decoded, URLs fetched (api/image_fetch.py), the bytes of all images together bounded
  (`max_image_bytes`), and each image checked (api/image_checks.py: format, a bomb's dimensions
  from its header, a truncated file);
- `for_model(engine)`, once the model is there: a model without a projector that takes the
  request's kind of media (ModelInfo.vision, ModelInfo.audio) answers a 400 naming it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from ..config.settings import Settings
from ..errors import InvalidRequestError
from ..protocol.engine import ModelEngine, TextEngine
from ..protocol.media import MEDIA_MARKER, AudioInput, ImageInput, MediaInput
from ..pull.policy import UrlPolicy
from .audio_checks import FORMATS as AUDIO_FORMATS
from .audio_checks import check_audio, sniff
from .image_checks import check_image, refused
from .image_fetch import fetch_image

_DATA_URL = re.compile(r"\Adata:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)
_SPACE = re.compile(rb"\s+")


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 16
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 25_000_000
    fetch_timeout: float = 20.0
    policy: UrlPolicy = field(default_factory=lambda: UrlPolicy(what="image URLs"))
    max_audio_seconds: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> "ImageLimits":
        return cls(settings.max_images_per_request, settings.max_image_bytes, settings.max_image_pixels,
                   settings.image_fetch_timeout, UrlPolicy.from_settings(settings, what="image URLs"),
                   settings.max_audio_seconds)


@dataclass(frozen=True)
class ImageRef:
    """One image part as parsed: base64 text (decoded in resolve) or an http(s) URL; or an audio
    clip's base64 in `audio_format` (of AUDIO_FORMATS); `audio_too`: either, by its bytes."""

    param: str
    base64: str | None = None
    url: str | None = None
    audio_format: str | None = None
    audio_too: bool = False


class ImageParts:
    """A request's image parts in prompt order, then (after `resolve`) its checked images."""

    def __init__(self, limits: ImageLimits | None = None):
        self.limits = limits or ImageLimits()
        self.refs: list[ImageRef] = []
        self.images: list[MediaInput] | None = None

    @classmethod
    def of(cls, settings: Settings) -> "ImageParts":
        return cls(ImageLimits.from_settings(settings))

    def __len__(self) -> int:
        return len(self.refs)

    def _add(self, ref: ImageRef) -> str:
        if len(self.refs) >= self.limits.max_images:
            raise refused(ref.param, f"is one image or clip more than the {self.limits.max_images} a request may "
                                      "hold (setting max_images_per_request)")
        self.refs.append(ref)
        self.images = None
        return MEDIA_MARKER

    def add_base64(self, value: Any, param: str, audio_too: bool = False) -> str:
        """A base64 image (Anthropic's `data`, Ollama's `images`), or with `audio_too` an image or an
        audio clip, told apart by its bytes (llama.cpp's `multimodal_data`)."""
        if not isinstance(value, str) or not value:
            raise refused(param, "must be a non-empty string of base64 image data")
        return self._add(self._sized(ImageRef(param, base64=value, audio_too=audio_too)))

    def add_audio(self, part: Any, param: str) -> str:
        """OpenAI's `input_audio` object, {"data": base64, "format": "wav" | "mp3"}, at `param`."""
        if not isinstance(part, dict):
            raise refused(param, "must be an object with 'data' (base64) and 'format' (\"wav\" or \"mp3\")")
        if part.get("format") not in AUDIO_FORMATS:
            raise refused(f"{param}.format", "must be \"wav\" or \"mp3\"")
        data = part.get("data")
        if not isinstance(data, str) or not data:
            raise refused(f"{param}.data", "must be a non-empty string of base64 audio data")
        return self._add(self._sized(ImageRef(f"{param}.data", base64=data, audio_format=part["format"])))

    def _sized(self, ref: ImageRef) -> ImageRef:
        """`ref`, unless its base64 alone decodes past max_image_bytes: refused before a byte is decoded."""
        assert ref.base64 is not None
        if len(ref.base64) // 4 * 3 > self.limits.max_bytes:
            raise refused(ref.param, f"is more than the {self.limits.max_bytes} bytes a request's images and clips "
                                      "may have (setting max_image_bytes)")
        return ref

    def add_url(self, value: Any, param: str) -> str:
        """An image URL: `data:image/...;base64,...` or an https link (fetched in resolve)."""
        if not isinstance(value, str) or not value:
            raise refused(param, "must be a non-empty string (a data: URL or an https:// link)")
        head = _DATA_URL.match(value[:256])
        if head is not None:
            media_type, params = head.group(1).strip().lower(), head.group(2).lower()
            if media_type and not media_type.startswith("image/"):
                raise refused(param, f"is a data: URL of {media_type[:40]!r}, not an image")
            if ";base64" not in params:
                raise refused(param, "must be a base64 data: URL (data:image/png;base64,...)")
            return self.add_base64(value[head.end():], param)
        if value[:5].lower() == "data:":
            raise refused(param, "is not a well-formed data: URL (data:image/png;base64,...)")
        if len(value) > 8192:
            raise refused(param, "is a URL longer than 8192 characters")
        try:
            replace(self.limits.policy, param=param).check_url(value)
        except InvalidRequestError as e:
            raise refused(param, f"is refused: {e.message}") from None
        return self._add(ImageRef(param, url=value))

    def check_markers(self, texts: Iterable[str], param: str) -> None:
        """The prompt's texts hold exactly one marker per image: a client's own text holding the
        marker would give an image a place it was not sent in (or a marker no image), so it is
        refused while the request has images (without images the marker is ordinary text)."""
        if not self.refs:
            return
        found = sum(text.count(MEDIA_MARKER) for text in texts)
        if found != len(self.refs):
            raise refused(param, f"holds the text {MEDIA_MARKER!r}, which marks an image's place in a prompt "
                                  "with images; remove it from the text")

    async def resolve(self) -> list[MediaInput]:
        """Every image decoded or fetched, bounded and checked (a worker thread: fetching and
        decoding block); idempotent."""
        if self.images is None:
            self.images = await asyncio.to_thread(self._resolve) if self.refs else []
        return self.images

    def _resolve(self) -> list[MediaInput]:
        out: list[MediaInput] = []
        left = self.limits.max_bytes
        seconds = 0.0
        for ref in self.refs:
            data = self._bytes(ref, left)
            left -= len(data)
            if left < 0:
                raise refused(ref.param, f"brings the request's images past {self.limits.max_bytes} bytes "
                                          "(setting max_image_bytes)")
            fmt = ref.audio_format or (sniff(data) if ref.audio_too else None)
            if fmt is None:
                out.append(check_image(data, ref.param, max_pixels=self.limits.max_pixels))
                continue
            clip = check_audio(data, fmt, ref.param)
            seconds += clip.seconds
            if seconds > self.limits.max_audio_seconds:
                raise refused(ref.param, f"brings the request's audio to {seconds:.1f} seconds, more than the "
                                          f"{self.limits.max_audio_seconds:g} it may have (setting max_audio_seconds)")
            out.append(clip)
        return out

    def _bytes(self, ref: ImageRef, left: int) -> bytes:
        if ref.url is not None:
            return fetch_image(ref.url, ref.param, self.limits.policy, max_bytes=max(left, 0),
                               timeout=self.limits.fetch_timeout)
        assert ref.base64 is not None
        text = ref.base64.encode("ascii", "replace")
        try:
            return base64.b64decode(_SPACE.sub(b"", text), validate=True)
        except (binascii.Error, ValueError):
            raise refused(ref.param, "is not valid base64") from None

    def for_model(self, engine: ModelEngine) -> list[MediaInput]:
        """The resolved images and clips for `engine`, or a 400 naming the model when its projector
        does not take their kind (checked before any template, tokenizing or generation)."""
        if not self.refs:
            return []
        if isinstance(engine, TextEngine):  # a remote upstream: its request is relayed as text
            ref = self.refs[0]
            kind = "is audio" if ref.audio_format else "is an image or audio" if ref.audio_too else "is an image"
            raise refused(ref.param, f"{kind}, and the remote model {engine.name!r} is sent text only "
                                     "(images and audio are not relayed to upstreams)")
        if self.images is None:
            raise RuntimeError("ImageParts.for_model before resolve()")  # generation() resolves first
        for ref, item in zip(self.refs, self.images):
            if isinstance(item, AudioInput) and not getattr(engine.info, "audio", False):
                raise refused(ref.param, f"is audio, and the model {engine.name!r} takes no audio: it has no "
                                         "projector that hears (mmproj). Use an audio model (README: Images and audio)")
            if isinstance(item, ImageInput) and not getattr(engine.info, "vision", False):
                raise refused(ref.param, f"is an image, and the model {engine.name!r} takes no images: it has "
                                         "no vision projector (mmproj). Use a vision model (README: Images and audio)")
        return self.images


def kept_images(kept: list[dict[str, Any]], messages: list[dict[str, Any]], images: list[MediaInput]) -> list[MediaInput]:
    """The images of the messages in `kept` (a history cut to its context: chat_history.py), from
    all `messages` and their images in order: message i holds as many as its text holds markers
    (check_markers made that exact)."""
    keep = {id(m) for m in kept}
    out, at = [], 0
    for message in messages:
        content = message.get("content")
        n = content.count(MEDIA_MARKER) if isinstance(content, str) else 0
        if id(message) in keep:
            out.extend(images[at:at + n])
        at += n
    return out
