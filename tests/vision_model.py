"""A SmolVLM-shaped projector for SmolLM2-135M, for the vision tests and benchmarks/vision.py.

No vision GGUF can be fetched on these machines, but SmolVLM-256M's language model is SmolLM2-135M
(576-wide embeddings). This writes the projector such a model ships beside it (`mmproj`): llama.cpp's
clip `idefics3` type, a SigLIP-style vision tower (patch embedding, position embedding, ViT blocks,
post-layernorm) and idefics3's pixel shuffle + linear projection to 576, from seeded random weights.
Its language model is SmolLM2 itself with two unused special tokens renamed to the ones
idefics3's image layout names (`<fake_token_around_image>`, `<global-img>`: SmolVLM's tokenizer has
them, SmolLM2's has not, and mtmd's tokenizer would put -1 where they go). So llama.cpp's whole
vision path (preprocessing, encoding, the embeddings entering the sequence) runs on our default
test model; what SmolLM2 makes of random image embeddings is beside the point,
but they are deterministic and differ from image to image.

Tiny on purpose (a 128-pixel image, 8-pixel patches, two 64-wide blocks): an encode is a few
milliseconds on a CPU. 256 patches shuffled by 2 make 64 image tokens, as SmolVLM's 512-pixel tile does.

    python tests/vision_model.py OUT_DIR    # OUT_DIR/smolvlm-text.gguf, smolvlm-mmproj.gguf, test-image.png
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

PROJECTOR_NAME = "smolvlm-mmproj.gguf"
MODEL_NAME = "smolvlm-text.gguf"
SMOLLM2 = (Path(__file__).resolve().parent.parent
           / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf")
# SmolLM2's <jupyter_output> and <jupyter_script> (control tokens no chat uses) under SmolVLM's names.
RENAMED_TOKENS = {14: "<fake_token_around_image>", 15: "<global-img>"}
IMAGE_SIZE = 128
PATCH_SIZE = 8
SCALE_FACTOR = 2  # idefics3's pixel shuffle: SCALE_FACTOR^2 patches become one token
HIDDEN = 64
HEADS = 4
FFN = 128
BLOCKS = 2
TEXT_EMBD = 576  # SmolLM2-135M's embedding width
SEED = 20260
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2


def write_text_model(smollm2: Path, out_dir: Path) -> Path:
    """SmolLM2's GGUF with RENAMED_TOKENS, as `out_dir`/MODEL_NAME (weights and all else as they are)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / MODEL_NAME
    reader = gguf.GGUFReader(smollm2, "r")
    tokens = list(reader.get_field(gguf.Keys.Tokenizer.LIST).contents())
    for token_id, text in RENAMED_TOKENS.items():
        tokens[token_id] = text
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    new = {gguf.Keys.Tokenizer.LIST: MetadataDetails(gguf.GGUFValueType.ARRAY, tokens,
                                                     sub_type=gguf.GGUFValueType.STRING)}
    copy_with_new_metadata(reader, writer, new, [])
    return out


class SeededWeights:
    """Random tensors from one seed, in the order asked: the same seed, the same projector."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape: int, std: float = 0.05) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """A layer norm's weight (about 1) and bias (about 0)."""
        return (1.0 + self(width, std=0.02)), self(width, std=0.02)


def write_gguf(writer: Any, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` to a gguf.GGUFWriter whose metadata is set, and write the file."""
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def encoder_blocks(weight: SeededWeights, prefix: str, blocks: int, hidden: int, ffn: int,
                   key_bias: bool = True) -> dict[str, np.ndarray]:
    """The transformer blocks of a clip encoder (`v.blk.N...` for vision, `a.blk.N...` for audio):
    attention, feed-forward and their layer norms, with biases (Whisper's key projection has none)."""
    tensors = {}
    for i in range(blocks):
        blk = f"{prefix}.blk.{i}"
        for name, (n_out, n_in) in {"attn_q": (hidden, hidden), "attn_k": (hidden, hidden),
                                    "attn_v": (hidden, hidden), "attn_out": (hidden, hidden),
                                    "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}.items():
            tensors[f"{blk}.{name}.weight"] = weight(n_out, n_in, std=n_in ** -0.5)
            if key_bias or name != "attn_k":
                tensors[f"{blk}.{name}.bias"] = weight(n_out, std=0.02)
        for ln in ("ln1", "ln2"):
            tensors[f"{blk}.{ln}.weight"], tensors[f"{blk}.{ln}.bias"] = weight.norm(hidden)
    return tensors


def write_projector(out_dir: Path, seed: int = SEED) -> Path:
    """Write the projector GGUF into `out_dir`; returns its path."""
    import gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PROJECTOR_NAME
    weight = SeededWeights(seed)
    w = gguf.GGUFWriter(str(path), arch="clip")
    w.add_name("localserve test SmolVLM projector")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    w.add_vision_projection_dim(TEXT_EMBD)
    w.add_vision_image_size(IMAGE_SIZE)
    w.add_vision_preproc_image_size(IMAGE_SIZE)  # the longest edge: one tile, no slices
    w.add_vision_patch_size(PATCH_SIZE)
    w.add_vision_embedding_length(HIDDEN)
    w.add_vision_feed_forward_length(FFN)
    w.add_vision_block_count(BLOCKS)
    w.add_vision_head_count(HEADS)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    w.add_vision_projector_scale_factor(SCALE_FACTOR)

    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    # numpy shapes are ggml's dimensions reversed: a linear layer is (out, in), as torch keeps it.
    tensors = {
        "v.patch_embd.weight": weight(HIDDEN, 3, PATCH_SIZE, PATCH_SIZE, std=0.1).astype(np.float16),
        "v.patch_embd.bias": weight(HIDDEN, std=0.02),
        "v.position_embd.weight": weight(n_patches, HIDDEN, std=0.1),
    }
    tensors |= encoder_blocks(weight, "v", BLOCKS, HIDDEN, FFN)
    tensors["v.post_ln.weight"], tensors["v.post_ln.bias"] = weight.norm(HIDDEN)
    # Rows of about SmolLM2's token embeddings' size, so the image neither vanishes nor drowns
    # the text around it.
    fc_in = HIDDEN * SCALE_FACTOR**2
    tensors["mm.model.fc.weight"] = weight(TEXT_EMBD, fc_in, std=0.2 * fc_in ** -0.5)
    write_gguf(w, tensors)
    return path


def test_image(seed: int, size: int = 96) -> bytes:
    """A PNG of seeded colour blocks and noise: same seed, same bytes; another seed, another
    picture altogether (not the same one with other noise, which a random tower barely tells apart)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (4, 4, 3))
    base = np.kron(blocks, np.ones((size // 4, size // 4, 1), dtype=np.int64))
    pixels = np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/vision_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    print(write_text_model(SMOLLM2, out))
    print(write_projector(out))
    (out / "test-image.png").write_bytes(test_image(1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
