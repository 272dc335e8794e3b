"""One audio clip's bytes checked before any model hears them (issue 43): WAV or MP3 as OpenAI's
`input_audio` names them, whole, and its length within bounds, all read from the file's own
structure without decoding a sample.

The engine decodes with llama.cpp's mtmd helper (miniaudio), which would take a truncated file or
a header that promises more than the file holds and decode whatever is there; checked here, each is
the client's 400 naming its field instead. The length counts: mtmd cuts audio into 30-second
windows and each becomes a fixed run of prompt positions, so `max_audio_seconds` bounds the encoder
work and the prompt a request may bring.

- WAV: the RIFF chunks walked to `fmt ` (PCM or IEEE float, the encodings miniaudio reads, possibly
  inside WAVE_FORMAT_EXTENSIBLE) and `data`, whose declared size must be there in full.
- MP3: every MPEG audio frame header walked from the first to the last (Layer III; an ID3v2 tag
  before, an ID3v1 tag after), so the length is exact for VBR files too, and a last frame cut short
  is found.
"""

from __future__ import annotations

import hashlib
import struct

from ..protocol.media import AudioInput
from .image_checks import refused

FORMATS = ("wav", "mp3")
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE

# MPEG audio frame headers (ISO 11172-3 / 13818-3), Layer III: kbit/s by bitrate index, Hz by
# sample-rate index, for MPEG-1 and for MPEG-2 / 2.5.
_BITRATES = {1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
             2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def check_audio(data: bytes, fmt: str, param: str) -> AudioInput:
    """`data` as an AudioInput, or a 400 naming `param`: empty, not the `fmt` (of FORMATS) its
    part names, damaged or truncated. Its `seconds` are bounded by the caller, over a request's
    clips together (api/images.py)."""
    if not data:
        raise refused(param, "is empty")
    found = sniff(data)
    if found is None:
        raise refused(param, "is not WAV or MP3 audio")
    if found != fmt:
        raise refused(param, f"is {found.upper()} audio, but its format says {fmt!r}")
    seconds = wav_seconds(data, param) if fmt == "wav" else mp3_seconds(data, param)
    return AudioInput(data=data, sha256=hashlib.sha256(data).hexdigest(), seconds=seconds, format=fmt)


def sniff(data: bytes) -> str | None:
    """"wav", "mp3" or None, from the first bytes (as miniaudio tells them apart)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def wav_seconds(data: bytes, param: str) -> float:
    """The length of a RIFF/WAVE file from its `fmt ` and `data` chunks; a 400 for anything else."""
    fmt: tuple[int, int, int, int] | None = None  # encoding, channels, rate, bits
    at = 12
    while at + 8 <= len(data):
        kind, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = data[at + 8:at + 8 + size]
        if kind == b"fmt ":
            if len(body) < 16:
                raise refused(param, "is a damaged WAV file (its fmt chunk is cut short)")
            encoding, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
            if encoding == _EXTENSIBLE and len(body) >= 26:
                encoding = struct.unpack_from("<H", body, 24)[0]  # the sub-format GUID's first two bytes
            fmt = (encoding, channels, rate, bits)
        elif kind == b"data":
            if fmt is None:
                raise refused(param, "is a damaged WAV file (data before its fmt chunk)")
            encoding, channels, rate, bits = fmt
            if encoding not in (_PCM, _FLOAT) or bits not in (8, 16, 24, 32, 64) or not channels or not rate:
                raise refused(param, f"is a WAV file this server does not read (encoding {encoding}, {bits}-bit); "
                                     "send PCM or float samples")
            if len(body) < size:
                raise refused(param, f"is a truncated WAV file ({len(body)} of its {size} bytes of samples)")
            return size / (channels * bits // 8) / rate
        at += 8 + size + (size & 1)  # chunks are word-aligned
    raise refused(param, "is a damaged or truncated WAV file (no data chunk)")


def mp3_seconds(data: bytes, param: str) -> float:
    """The length of an MP3 file by walking its frames; a 400 for a damaged or cut-short one."""
    at = 0
    if data[:3] == b"ID3" and len(data) >= 10:  # ID3v2: a syncsafe size, 7 bits a byte
        at = 10 + sum((b & 0x7F) << (7 * (3 - i)) for i, b in enumerate(data[6:10]))
    end = len(data) - 128 if data[-128:-125] == b"TAG" else len(data)  # ID3v1
    samples = frames = 0
    while at < end:
        frame = _frame(data, at)
        if frame is None:
            break
        length, n_samples, rate = frame
        if at + length > end:
            raise refused(param, f"is a truncated MP3 file (its frame {frames + 1} is cut short)")
        samples += n_samples
        frames += 1
        at += length
    if frames == 0:
        raise refused(param, "is not MP3 audio this server reads (no MPEG Layer III frame)")
    if at < end:
        raise refused(param, f"is a damaged MP3 file (no frame where frame {frames + 1} should begin)")
    return samples / rate


def _frame(data: bytes, at: int) -> tuple[int, int, int] | None:
    """(bytes, samples, Hz) of the Layer III frame whose header is at `at`, or None."""
    if at + 4 > len(data):
        return None
    b1, b2, b3 = data[at + 1], data[at + 2], data[at + 3]
    version, layer = (b1 >> 3) & 3, (b1 >> 1) & 3  # version 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5
    bitrate_index, rate_index = b2 >> 4, (b2 >> 2) & 3
    if data[at] != 0xFF or b1 & 0xE0 != 0xE0 or version == 1 or layer != 1 or rate_index == 3 \
            or bitrate_index in (0, 15) or b3 & 3 == 2:
        return None  # not a frame, another layer, free-format or reserved fields
    mpeg1 = version == 3
    kbps = _BITRATES[1 if mpeg1 else 2][bitrate_index]
    rate = _RATES[version][rate_index]
    n_samples = 1152 if mpeg1 else 576
    length = n_samples // 8 * kbps * 1000 // rate + ((b2 >> 1) & 1)
    return length, n_samples, rate
