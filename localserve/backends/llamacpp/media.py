"""A model's projector (mmproj) through llama.cpp's mtmd library: a prompt's images become positions
of its token list, and those positions the embeddings a decode reads (issue 43). Audio clips take
the same path: mtmd cuts a clip into 30-second windows, each a chunk like an image's tile, so
"image" below reads "image or clip" throughout.

**Images as prompt positions.** `tokenize` runs mtmd's tokenizer over the rendered prompt (one
MEDIA_MARKER per image) and returns one flat list: text tokens as they are, and for each image chunk
(a tile, an overview) one negative id per position (protocol/media_ids.py: the chunk's key from the
image's sha256, and the row), so the same image gives the same ids in every request and the prefix
cache, which matches ids, reuses its cells, while two different images never share an id. The
scheduler plans these positions as any prompt tokens (chunks, lanes, budget);
the backend decodes a run of them as a `llama_batch` of embeddings, since llama.cpp takes tokens or
embeddings in one batch, never both (llama-server decodes an image chunk on its own too).

**Encoding.** A chunk is encoded (`mtmd_encode_chunk`, the vision tower and projection) on the
engine thread, in the step whose decode first needs one of its rows, and its embeddings are kept
while a request holds the image (and a few more after, for the next question about it): a
preempted request re-fed from scratch, or one whose prefix hit ends inside the image, reads them
again without encoding again. The scheduler charges that step for the encode
(batching/encode_charge.py).

Only what llama.cpp decodes as plain causal positions is served: a projector whose model takes
M-RoPE positions (Qwen2-VL's 2-D ones) or non-causal attention over an image (Gemma 3) would need
the batch to carry them and the scheduler to keep an image whole; such a projector loads with
`vision` off, and the log says why.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from llama_cpp import mtmd_cpp as mtmd

from ...errors import BackendError, InvalidRequestError
from ...protocol.media import MEDIA_MARKER, AudioInput, MediaInput
from ...protocol.media_ids import ROW_BITS, ROW_MASK, media_ids
from .runtime import captured_log

log = logging.getLogger(__name__)

_KEY_BYTES = 5  # 40 bits of sha256: two different images sharing a key is a 1-in-10^12 event
_IDLE_CHUNKS = 16  # chunks no request holds, kept (with their embeddings) for the next question
_MTMD_TEXT = 0  # MTMD_INPUT_CHUNK_TYPE_TEXT


def split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chunk key, row) of each media id (protocol/media_ids.py, for a whole array)."""
    k = -ids.astype(np.int64) - 1
    return k >> ROW_BITS, k & ROW_MASK


def chunk_key(sha256: str, ordinal: int) -> int:
    """The key of an image's `ordinal`-th chunk (its tiles, then its overview): the same image gives
    the same keys in every request."""
    digest = hashlib.sha256(f"{sha256}:{ordinal}".encode()).digest()
    return int.from_bytes(digest[:_KEY_BYTES], "big")


@dataclass
class _Chunk:
    ptr: Any  # an owned mtmd_input_chunk (mtmd_input_chunk_copy), freed with the entry
    n_tokens: int
    sha256: str  # of the image it is part of
    embd: np.ndarray | None = None  # (n_tokens, n_embd) float32 once encoded
    refs: int = 0  # requests holding it


class Projector:
    """One loaded mmproj beside its text model. Thread-safe: tokenizing runs on the worker's
    threads while the engine thread encodes, both under one lock (mtmd's context is not shared)."""

    def __init__(self, ctx: Any, n_embd: int) -> None:
        self.ctx = ctx
        self.n_embd = n_embd
        self._lock = threading.RLock()
        self._chunks: dict[int, _Chunk] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._closed = False
        self.vision = self.audio = False
        self.why_not = ""  # why a projector that sees is not used (a log line)
        if mtmd.mtmd_support_vision(ctx) or mtmd.mtmd_support_audio(ctx):
            self.why_not = self._unsupported()
        if not self.why_not:
            self.vision = bool(mtmd.mtmd_support_vision(ctx))
            self.audio = bool(mtmd.mtmd_support_audio(ctx))

    def _unsupported(self) -> str:
        """What of this projector's decoding the engine does not do, or "" (module doc)."""
        if mtmd.mtmd_decode_use_mrope(self.ctx):
            return "it needs M-RoPE positions"
        if not mtmd.mtmd_support_vision(self.ctx):
            return ""
        # Whether an image is decoded with non-causal attention is a property of its chunks: ask
        # with a small grey one.
        pixels = (ctypes.c_uint8 * (32 * 32 * 3))(*([128] * (32 * 32 * 3)))
        bitmap = mtmd.mtmd_bitmap_init(32, 32, pixels)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            marker = MEDIA_MARKER.encode()
            text = mtmd.mtmd_input_text(marker, len(marker), False, True)
            array = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), array, 1) != 0:
                return "it refused a small test image"
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                image = mtmd.mtmd_input_chunk_get_type(chunk) != _MTMD_TEXT
                if image and mtmd.mtmd_decode_use_non_causal(self.ctx, chunk):
                    return "it needs each image decoded whole, with non-causal attention"
            return ""
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Any, n_embd: int, n_threads: int,
             use_gpu: bool) -> "Projector":
        """The projector at `path` for the loaded text `model`; BackendError naming only the file
        (llama.cpp's log lines name the full path) when mtmd cannot load it for this model."""
        path = Path(path)
        if not path.is_file():
            raise BackendError(f"projector file {path.name!r} does not exist")
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False  # the first image pays its graph; a load without images pays nothing
        params.media_marker = MEDIA_MARKER.encode()
        with captured_log():
            ctx = mtmd.mtmd_init_from_file(os.fsencode(path), model, params)
        if not ctx:
            raise BackendError(f"could not load projector {path.name!r} for this model "
                               "(not a projector, or made for another model)")
        projector = cls(ctx, n_embd)
        if projector.why_not:
            log.warning("projector %s loaded, but images stay off for this model: %s, which this engine "
                        "does not do yet", path.name, projector.why_not)
        return projector

    # --- prompts -----------------------------------------------------------------------------
    def tokenize(self, text: str, images: Sequence[MediaInput], add_special: bool = True) -> list[int]:
        """The prompt's ids: text tokens, and each image's positions as media ids (module doc).
        InvalidRequestError when the markers and images do not pair up or mtmd refuses an image."""
        with self._lock:
            self._check_open()
            bitmaps = [self._bitmap(image) for image in images]
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                data = text.encode("utf-8", errors="replace")
                prompt = mtmd.mtmd_input_text(data, len(data), add_special, True)
                array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
                rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(prompt), array, len(bitmaps))
                if rc == 1:
                    raise InvalidRequestError(f"the prompt has {text.count(MEDIA_MARKER)} image places for "
                                              f"{len(images)} images", param="messages")
                if rc != 0:
                    raise InvalidRequestError("an image could not be prepared for this model", param="messages")
                return self._read(chunks)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                for bitmap in bitmaps:
                    mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, image: MediaInput) -> Any:
        # mtmd's helper tells audio (WAV, MP3, FLAC: miniaudio, resampled to the projector's rate)
        # from an image (stb_image) by the bytes.
        buf = (ctypes.c_uint8 * len(image.data)).from_buffer_copy(image.data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(image.data), False)
        if not bitmap:
            what = "an audio clip" if isinstance(image, AudioInput) else "an image"
            raise InvalidRequestError(f"{what} ({image.format}, {len(image.data)} bytes) could not be decoded",
                                      param="messages")
        mtmd.mtmd_bitmap_set_id(bitmap, image.sha256.encode())
        return bitmap

    def _read(self, chunks: Any) -> list[int]:
        tokens: list[int] = []
        ordinals: collections.Counter[str] = collections.Counter()
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if mtmd.mtmd_input_chunk_get_type(chunk) == _MTMD_TEXT:
                count = ctypes.c_size_t()
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                text = [ids[j] for j in range(count.value)]
                if any(t < 0 for t in text):  # a token mtmd's image layout names is not in the vocabulary
                    raise InvalidRequestError("this model's vocabulary lacks a token its projector's image "
                                              "layout needs", param="model")
                tokens.extend(text)
                continue
            sha256 = (mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
            key = chunk_key(sha256, ordinals[sha256])
            ordinals[sha256] += 1
            if key not in self._chunks:
                self._chunks[key] = _Chunk(mtmd.mtmd_input_chunk_copy(chunk), n, sha256)
                self._idle[key] = None
                self._trim()
            tokens.extend(media_ids(key, n))
        return tokens

    # --- requests ----------------------------------------------------------------------------
    def hold(self, tokens: Sequence[int], images: Sequence[MediaInput]) -> list[int]:
        """Keep the chunks of `tokens`' media ids for a request (until `release`); a chunk this
        process does not know (its tokenizer ran in another process, or the entry was dropped) is
        prepared again from `images`. InvalidRequestError for ids no image of the request makes."""
        keys = sorted({int(k) for k in split_ids(np.array([t for t in tokens if t < 0], dtype=np.int64))[0]})
        with self._lock:
            self._check_open()
            if any(key not in self._chunks for key in keys):
                for image in images:
                    self.tokenize(MEDIA_MARKER, [image], add_special=False)
            own = {image.sha256 for image in images}
            if any(key not in self._chunks or self._chunks[key].sha256 not in own for key in keys):
                raise InvalidRequestError("the prompt has image positions that none of its images makes",
                                          param="prompt")
            for key in keys:
                chunk = self._chunks[key]
                chunk.refs += 1
                self._idle.pop(key, None)
        return keys

    def release(self, keys: Iterable[int]) -> None:
        with self._lock:
            for key in keys:
                chunk = self._chunks.get(key)
                if chunk is None:
                    continue
                chunk.refs -= 1
                if chunk.refs <= 0:
                    chunk.refs = 0
                    self._idle[key] = None
            self._trim()

    def _trim(self) -> None:
        while len(self._idle) > _IDLE_CHUNKS:
            key, _ = self._idle.popitem(last=False)
            mtmd.mtmd_input_chunk_free(self._chunks.pop(key).ptr)

    # --- decoding ----------------------------------------------------------------------------
    def embeddings(self, ids: np.ndarray) -> np.ndarray:
        """The embedding rows of media ids (n, n_embd), encoding each chunk the first time."""
        keys, rows = split_ids(ids)
        out = np.empty((len(ids), self.n_embd), dtype=np.float32)
        with self._lock:
            self._check_open()
            for key in np.unique(keys):
                chunk = self._chunks.get(int(key))
                if chunk is None:
                    raise ValueError("an image row of this batch belongs to no image held")
                if chunk.embd is None:
                    chunk.embd = self._encode(chunk)
                where = keys == key
                out[where] = chunk.embd[rows[where]]
        return out

    def _encode(self, chunk: _Chunk) -> np.ndarray:
        rc = mtmd.mtmd_encode_chunk(self.ctx, chunk.ptr)
        if rc != 0:
            raise BackendError(f"encoding an image failed (mtmd code {rc})")
        ptr = mtmd.mtmd_get_output_embd(self.ctx)
        n = chunk.n_tokens * self.n_embd
        return np.ctypeslib.as_array(ptr, shape=(n,)).copy().reshape(chunk.n_tokens, self.n_embd)

    # --- lifecycle ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the model has been unloaded")

    def close(self) -> None:
        """Free every chunk and the context: before the text model it was loaded with."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for chunk in self._chunks.values():
                mtmd.mtmd_input_chunk_free(chunk.ptr)
            self._chunks.clear()
            self._idle.clear()
            mtmd.mtmd_free(self.ctx)
