"""An Ultravox-shaped audio projector for SmolLM2-135M, for the audio tests (issue 43).

No audio GGUF can be fetched on these machines. Ultravox pairs a Whisper encoder with a small
projector onto a text model's embeddings; this writes such a projector (`mmproj`) for SmolLM2's
576-wide embeddings from seeded random weights: llama.cpp's clip `ultravox` type (two 1-D
convolutions over the log-mel frames, Whisper encoder blocks, post-layernorm, frames stacked by 4,
then RMS-norm, SwiGLU and RMS-norm into 576). Ultravox puts no begin/end tokens around a clip, so
the text model is SmolLM2 itself, unchanged. llama.cpp's whole audio path then runs on our default
model: the WAV or MP3 decoded and resampled to 16 kHz (miniaudio), the log-mel spectrogram, the
encoder, and the embeddings entering the sequence.

Tiny on purpose (64 wide, two blocks); mtmd cuts audio into 30-second windows of 3,000 mel frames
and each window becomes 3000 / 2 / 4 = 375 positions, however short the clip.

    python tests/audio_model.py OUT_DIR    # OUT_DIR/ultravox-mmproj.gguf, test-audio.wav
"""

from __future__ import annotations

import io
import sys
import wave
from pathlib import Path

import numpy as np

from vision_model import SeededWeights, encoder_blocks, write_gguf

PROJECTOR_NAME = "ultravox-mmproj.gguf"
N_MEL = 80  # Whisper's log-mel bins
HIDDEN = 64
HEADS = 4
FFN = 128
BLOCKS = 2
STACK = 4  # frames stacked (Ultravox's own 8 gives 188 rows where llama.cpp counts 187, and it aborts)
PROJ_FFN = 256  # the projector's SwiGLU width
TEXT_EMBD = 576  # SmolLM2-135M's embedding width
N_POS = 1500  # encoder positions of one 30-second window (3,000 mel frames, halved by the 2nd conv)
SEED = 20261
TOKENS_PER_WINDOW = N_POS // STACK  # 375: what one clip of up to 30 s becomes
SAMPLE_RATE = 16_000


def write_projector(out_dir: Path, seed: int = SEED) -> Path:
    """Write the projector GGUF into `out_dir`; returns its path."""
    import gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PROJECTOR_NAME
    weight = SeededWeights(seed)

    w = gguf.GGUFWriter(str(path), arch="clip")
    w.add_name("localserve test Ultravox projector")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_audio_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.ULTRAVOX)
    w.add_audio_projection_dim(TEXT_EMBD)
    w.add_audio_embedding_length(HIDDEN)
    w.add_audio_feed_forward_length(FFN)
    w.add_audio_block_count(BLOCKS)
    w.add_audio_head_count(HEADS)
    w.add_audio_attention_layernorm_eps(1e-5)
    w.add_audio_num_mel_bins(N_MEL)
    w.add_audio_stack_factor(STACK)

    # numpy shapes are ggml's dimensions reversed: a linear layer is (out, in), as torch keeps it; a
    # 1-D convolution's kernel (out, in, width) in f16 (ggml's im2col), its bias a column (out, 1).
    tensors = {
        "a.conv1d.1.weight": weight(HIDDEN, N_MEL, 3, std=(3 * N_MEL) ** -0.5).astype(np.float16),
        "a.conv1d.1.bias": weight(HIDDEN, 1, std=0.02),
        "a.conv1d.2.weight": weight(HIDDEN, HIDDEN, 3, std=(3 * HIDDEN) ** -0.5).astype(np.float16),
        "a.conv1d.2.bias": weight(HIDDEN, 1, std=0.02),
        "a.position_embd.weight": weight(N_POS, HIDDEN, std=0.1),
    }
    # Whisper's key projection has no bias (llama.cpp asserts it).
    tensors |= encoder_blocks(weight, "a", BLOCKS, HIDDEN, FFN, key_bias=False)
    tensors["a.post_ln.weight"], tensors["a.post_ln.bias"] = weight.norm(HIDDEN)
    stacked = HIDDEN * STACK
    tensors["mm.a.norm_pre.weight"] = weight.norm(stacked)[0]
    tensors["mm.a.mlp.1.weight"] = weight(2 * PROJ_FFN, stacked, std=stacked ** -0.5)
    tensors["mm.a.norm_mid.weight"] = weight.norm(PROJ_FFN)[0]
    # Rows of about SmolLM2's token embeddings' size, so the clip neither vanishes nor drowns the
    # text around it (as the vision projector's last layer, tests/vision_model.py).
    tensors["mm.a.mlp.2.weight"] = weight(TEXT_EMBD, PROJ_FFN, std=0.2 * PROJ_FFN ** -0.5)
    write_gguf(w, tensors)
    return path


def test_audio(seed: int, seconds: float = 1.0, rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV of seeded tones and noise: same seed, same bytes; another seed, other
    tones (a different clip altogether, which a random encoder tells apart)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(np.sin(2 * np.pi * f * t + phase) for f, phase in zip(rng.uniform(150, 3000, 4), rng.uniform(0, 6, 4)))
    signal = 0.2 * tones + 0.05 * rng.standard_normal(len(t))
    pcm = (np.clip(signal, -1, 1) * 32000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def silent_mp3(frames: int = 40, id3: bool = False) -> bytes:
    """An MPEG-1 Layer III stream of `frames` silent frames (128 kbit/s, 44.1 kHz, 1,152 samples
    and 417 bytes each, ~26 ms): a header and all-zero side information and main data, which every
    decoder (miniaudio's too) reads as silence. No MP3 encoder ships here; this is a real one.
    `id3`: with an ID3v2 tag before the frames and an ID3v1 tag after, as taggers leave them."""
    frame = bytes([0xFF, 0xFB, 0x90, 0xC0]) + bytes(417 - 4)  # sync, MPEG-1 L3 no CRC; 128k 44.1k; mono
    body = frame * frames
    if not id3:
        return body
    tag = b"TIT2" + (6).to_bytes(4, "big") + b"\x00\x00" + b"\x00quiet"
    return b"ID3\x04\x00\x00" + bytes([0, 0, 0, len(tag)]) + tag + body + b"TAG" + bytes(125)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/audio_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    print(write_projector(out))
    (out / "test-audio.wav").write_bytes(test_audio(1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
