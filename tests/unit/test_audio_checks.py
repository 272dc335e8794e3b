"""Audio input checked before any model work (api/audio_checks.py, api/images.py): real WAV files
(the stdlib's writer, 16-bit PCM; a float one built by hand), real MP3 streams (silent Layer III
frames, with and without ID3 tags), and each refusal a client can cause: a wrong or missing format,
bytes that are neither, a truncated file, a header promising more than the file holds, an encoding
the decoder does not read, too many seconds, and the parts' shapes in each dialect's parser."""

from __future__ import annotations

import asyncio
import base64
import io
import struct

import pytest
from PIL import Image

import audio_model
from localserve.api.audio_checks import check_audio
from localserve.api.images import ImageLimits, ImageParts
from localserve.api.responses_items import chat_messages, parse_input
from localserve.api.validation import parse_messages
from localserve.errors import InvalidRequestError
from localserve.protocol.media import MEDIA_MARKER, AudioInput, ImageInput

WAV = audio_model.test_audio(1, seconds=1.5)
MP3 = audio_model.silent_mp3(frames=40)


def refusal(data: bytes, fmt: str = "wav") -> str:
    with pytest.raises(InvalidRequestError) as e:
        check_audio(data, fmt, "messages[0].content[0].input_audio.data")
    assert e.value.param == "messages[0].content[0].input_audio.data"
    return e.value.message


def float_wav(samples: int, rate: int = 16_000, declared: int | None = None) -> bytes:
    data = struct.pack(f"<{samples}f", *([0.25] * samples))
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    size = len(data) if declared is None else declared
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + size) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt))
            + fmt + b"data" + struct.pack("<I", size) + data)


def test_a_wav_and_an_mp3_are_measured_from_their_own_structure():
    clip = check_audio(WAV, "wav", "p")
    assert isinstance(clip, AudioInput) and clip.format == "wav" and clip.seconds == pytest.approx(1.5)
    assert clip.data == WAV and len(clip.sha256) == 64
    assert check_audio(float_wav(8000), "wav", "p").seconds == pytest.approx(0.5)
    # 40 MPEG-1 frames of 1,152 samples at 44.1 kHz; the tags around them are skipped.
    for data in (MP3, audio_model.silent_mp3(frames=40, id3=True)):
        assert check_audio(data, "mp3", "p").seconds == pytest.approx(40 * 1152 / 44100)


def test_bytes_that_are_not_the_named_format_are_refused():
    assert "is MP3 audio, but its format says 'wav'" in refusal(MP3, "wav")
    assert "is WAV audio, but its format says 'mp3'" in refusal(WAV, "mp3")
    assert "is not WAV or MP3 audio" in refusal(b"OggS" + bytes(200))
    assert "is empty" in refusal(b"")


def test_a_truncated_or_lying_file_is_refused_before_the_decoder():
    assert "truncated WAV file" in refusal(WAV[:len(WAV) // 2])
    # A header that promises an hour of samples the file does not hold (miniaudio would read what is there).
    assert "truncated WAV file" in refusal(float_wav(100, declared=16_000 * 4 * 3600))
    assert "no data chunk" in refusal(WAV[:40])
    assert "truncated MP3 file (its frame 40 is cut short)" in refusal(MP3[:-100], "mp3")
    assert "damaged MP3 file (no frame where frame 11 should begin)" in refusal(MP3[:417 * 10] + b"junk" * 30, "mp3")
    assert "no MPEG Layer III frame" in refusal(b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(100), "mp3")


def test_an_encoding_the_decoder_does_not_read_is_refused():
    adpcm = bytearray(WAV)
    struct.pack_into("<H", adpcm, 20, 2)  # the fmt chunk's encoding: Microsoft ADPCM
    assert "does not read (encoding 2, 16-bit)" in refusal(bytes(adpcm))


def openai_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_openai_input_audio_parts_become_markers_and_clips_in_prompt_order():
    parts = ImageParts()
    messages = parse_messages([{"role": "user", "content": [
        {"type": "text", "text": "Hear "}, openai_audio(WAV), {"type": "text", "text": " and "}, openai_audio(MP3, "mp3")]}],
        images=parts)
    assert messages[0]["content"] == f"Hear {MEDIA_MARKER} and {MEDIA_MARKER}"
    clips = asyncio.run(parts.resolve())
    assert [c.format for c in clips] == ["wav", "mp3"] and all(isinstance(c, AudioInput) for c in clips)


@pytest.mark.parametrize("part, field, words", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, "input_audio.format", "must be \"wav\" or \"mp3\""),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data", "non-empty string of base64 audio"),
    ({"type": "input_audio", "input_audio": "AAAA"}, "input_audio", "must be an object with 'data'"),
])
def test_a_malformed_input_audio_part_names_its_field(part, field, words):
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([{"role": "user", "content": [part]}], images=ImageParts())
    assert e.value.param == f"messages[0].content[0].{field}" and words in e.value.message


def test_clips_share_the_request_bounds_with_images():
    parts = ImageParts(ImageLimits(max_images=1))
    parse_messages([{"role": "user", "content": [openai_audio(WAV)]}], images=parts)
    with pytest.raises(InvalidRequestError, match="one image or clip more than the 1"):
        parse_messages([{"role": "user", "content": [openai_audio(WAV)]}], images=parts)
    # Seconds are counted over the request's clips together: the second 1.5-second clip is one too many.
    parts = ImageParts(ImageLimits(max_audio_seconds=2.0))
    parse_messages([{"role": "user", "content": [openai_audio(WAV), openai_audio(WAV)]}], images=parts)
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(parts.resolve())
    assert e.value.param == "messages[0].content[1].input_audio.data"
    assert "brings the request's audio to 3.0 seconds, more than the 2 it may have (setting max_audio_seconds)" \
        in e.value.message


def test_llama_cpp_multimodal_data_is_told_apart_by_its_bytes():
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(png, format="PNG")
    parts = ImageParts()
    for i, data in enumerate((WAV, png.getvalue(), MP3)):
        parts.add_base64(base64.b64encode(data).decode(), f"multimodal_data[{i}]", audio_too=True)
    kinds = [type(m) for m in asyncio.run(parts.resolve())]
    assert kinds == [AudioInput, ImageInput, AudioInput]


def test_responses_input_audio_is_kept_in_the_item_and_reaches_the_same_path():
    items = parse_input([{"role": "user", "content": [
        {"type": "input_text", "text": "What is this? "}, openai_audio(WAV)]}])
    assert items[0]["content"][1] == openai_audio(WAV)  # stored as sent: a continuation sends it again
    parts = ImageParts()
    messages = chat_messages(None, items, parts)
    assert messages[-1]["content"] == f"What is this? {MEDIA_MARKER}"
    assert isinstance(asyncio.run(parts.resolve())[0], AudioInput)
    with pytest.raises(InvalidRequestError) as e:
        parse_input([{"role": "assistant", "content": [openai_audio(WAV)]}])
    assert "audio goes in user messages" in e.value.message
