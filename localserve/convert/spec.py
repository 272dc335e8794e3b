"""What a GGUF must be for our converter, read and checked before any work.

`read_spec` opens the GGUF (a memory map: cheap), and refuses an architecture, a feature or a
tensor type we cannot convert *before* anything is dequantized or written, naming what is missing
and what is supported, so a user learns in a second, not after minutes of work.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import numpy as np

from ..errors import GGUFError
from .model_spec import ModelSpec
from .bounds import (SERVING_POSITIONS, check_layer_count, check_memory, check_shapes, check_vocab, finite_float,
                     positive_int, rope_positions)

# llama: SmolLM2, Llama 2/3, Mistral as llama.cpp writes them. qwen2: llama plus q/k/v biases and
# NEOX ("half split") rope on unpermuted q/k weights.
SUPPORTED_ARCHS = ("llama", "qwen2")
# Types gguf's numpy reference dequantizes (gguf.quants), all checked against llama.cpp on the
# converter's tests through the Q4_1/Q8_0/F32 test model; the rest share gguf's code path.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down")


class UnsupportedModelError(GGUFError):
    """The GGUF is valid but holds something the converter does not handle (named in the message)."""

    code = "unsupported_model"


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def open_reader(path: Path):
    """A GGUFReader over `path`, or GGUFError (no host path in the message)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise GGUFError(f"{Path(path).name} is not a readable GGUF file ({type(e).__name__})") from None


def read_spec(reader, max_positions: int = SERVING_POSITIONS) -> ModelSpec:
    """The model's shape from its metadata, checked against its tensors and this machine's memory
    (bounds.py); UnsupportedModelError or GGUFError before any work if we cannot convert it.
    `max_positions`: the most positions serving the result can reach (the rope tables' cap)."""
    arch = str(_field(reader, "general.architecture", "") or "")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"architecture {arch or '(none)'!r} is not supported by the ONNX converter "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    need = {name: _field(reader, f"{arch}.{name}") for name in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count")}
    missing = [f"{arch}.{k}" for k, v in need.items() if v is None]
    if missing:
        raise UnsupportedModelError(f"the GGUF lacks metadata the converter needs: {', '.join(missing)}")
    experts = _field(reader, f"{arch}.expert_count", 0)
    if not isinstance(experts, numbers.Integral) or experts > 0:
        raise UnsupportedModelError("mixture-of-experts models are not supported by the ONNX converter "
                                    "(supported: dense llama and qwen2 models)")
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none") or "none")
    if scaling != "none":
        raise UnsupportedModelError(f"rope scaling {scaling!r} is not supported by the ONNX converter "
                                    "(supported: none, and llama 3's rope_freqs factors)")
    _check_types(reader)

    def count(key: str, default: int | None = None) -> int:
        return positive_int(_field(reader, f"{arch}.{key}", default), f"{arch}.{key}")

    names = {t.name for t in reader.tensors}
    n_layer = count("block_count")
    qkv_bias = arch == "qwen2"
    check_layer_count(n_layer, len(names), len(_LAYER_TENSORS) + (3 if qkv_bias else 0))
    wanted = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{t}.weight" for i in range(n_layer) for t in _LAYER_TENSORS]
    if qkv_bias:
        wanted += [f"blk.{i}.attn_{p}.bias" for i in range(n_layer) for p in "qkv"]
    absent = [n for n in wanted if n not in names]
    if absent:
        raise UnsupportedModelError(f"the GGUF lacks {len(absent)} tensor(s) a {arch} model needs, "
                                    f"e.g. {', '.join(absent[:3])}")
    n_embd, n_head = count("embedding_length"), count("attention.head_count")
    n_head_kv = count("attention.head_count_kv", n_head)
    head_dim = count("attention.key_length", max(n_embd // n_head, 1))
    if head_dim * n_head != n_embd or n_head % n_head_kv or head_dim % 2:
        raise UnsupportedModelError(f"head layout {n_head}x{head_dim} (kv heads {n_head_kv}) for width "
                                    f"{n_embd} is not supported (needs heads x head size = width)")
    rope_dim = count("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_ctx_train = count("context_length", 4096)
    spec = ModelSpec(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=count("feed_forward_length"),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_vocab=int(embd.shape[-1]),
        n_ctx_train=n_ctx_train, n_positions=rope_positions(n_ctx_train, max_positions),
        rope_base=finite_float(_field(reader, f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base"),
        rms_eps=finite_float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
                             f"{arch}.attention.layer_norm_rms_epsilon", zero_ok=True),
        rope_interleaved=arch == "llama",
        qkv_bias=qkv_bias,
        tied_embeddings="output.weight" not in names,
        rope_freqs="rope_freqs.weight" in names,
    )
    check_shapes(reader, spec)  # n_vocab above is the table's last dim: its shape check is here too
    check_vocab(reader, spec)
    check_memory(spec)
    return spec


def _check_types(reader) -> None:
    bad: dict[str, str] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if name not in SUPPORTED_TYPES:
            bad.setdefault(name, t.name)
    if bad:
        found = ", ".join(f"{q} (e.g. {n})" for q, n in bad.items())
        raise UnsupportedModelError(f"tensor type(s) {found} are not supported by the ONNX converter "
                                    f"(supported: {', '.join(SUPPORTED_TYPES)})")


def tensor_f32(tensor) -> np.ndarray:
    """One GGUF tensor dequantized to float32, in numpy's [rows=out, cols=in] order."""
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
