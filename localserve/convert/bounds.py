"""What a GGUF claims about its shape, held against its own tensors and this machine before any work.

The metadata is the file's word; the tensors are what it holds. The converter sizes its graph and
its rope tables from the metadata, so a 116 KiB file claiming a 2^26-token context once asked for
16 GiB of tables (MemoryError in the daemon, on conversion at first use), and one claiming 2^20
became a 256 MiB folder. So here, before anything is dequantized or allocated:

- every count is a positive integer, and the layer count fits the tensors the file has (it sizes
  the list of tensor names read_spec builds);
- the width, the head layout and the feed-forward width match every tensor they shape, and the
  vocabulary is the embedding table's;
- the rope tables cover only the positions serving can reach (`rope_positions`), not a claimed
  context past that, and a claim past any trained model's is refused as a broken file;
- the largest array the conversion holds at once fits the memory available.

Messages name tensors and numbers, never a path.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import psutil

from ..backends.onnx.kv import MAX_SLOTS
from ..errors import GGUFError

if TYPE_CHECKING:
    from .model_spec import ModelSpec

# The ONNX backend's KV pool never exceeds MAX_SLOTS, so no sequence reaches a position past it
# (onnxruntime-genai folders run at most oga.loader.MAX_LENGTH = 4096); tables longer than this
# are bytes on disk nothing reads. The static flavour's fixed pool may be larger: its caller
# passes that size instead.
SERVING_POSITIONS = MAX_SLOTS
# The longest context any released model is trained on is about 10M tokens (Llama 4 Scout); a
# claim past 2^24 is a broken or hostile file, refused rather than quietly served as 8,192.
MAX_CONTEXT_CLAIM = 1 << 24
# Peak bytes per element of the largest prepared array: the dequantized parts, their
# concatenation and the transposed copy written out (weights.py) are float32 copies alive at once,
# and gguf's dequantizers add about one more of temporaries.
_PREPARED_COPIES_BYTES = 4 * 4
# rope_tables: the float64 angles, one float64 cos (or sin) on its way to float32, both float32 tables.
_ROPE_BYTES = 8 + 8 + 4 + 4
# Of the memory available, what one conversion may count on: the daemon and its loaded models live beside it.
_MEMORY_SHARE = 0.8


class ConversionMemoryError(GGUFError):
    """The conversion would need more memory at once than this machine has available."""

    code = "insufficient_memory"


def positive_int(value: Any, key: str) -> int:
    """A metadata count as a positive int, or GGUFError: arrays (per-layer values), strings,
    floats and non-positive numbers are not counts the converter can size anything by."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        shown = f"a list of {len(value)}" if isinstance(value, (list, tuple)) else repr(value)[:40]
        raise GGUFError(f"metadata {key} must be a positive integer (found {shown})")
    return int(value)


def finite_float(value: Any, key: str, zero_ok: bool = False) -> float:
    """A metadata real as a finite float above zero (or at least zero), or GGUFError: a rope base
    of 0 or NaN would fill the tables with inf/NaN, not fail."""
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value >= 0 if zero_ok else value > 0))
    if not ok:
        raise GGUFError(f"metadata {key} must be a finite number {'of at least' if zero_ok else 'above'} 0 "
                        f"(found {repr(value)[:40]})")
    return float(value)


def check_layer_count(n_layer: int, n_tensors: int, per_layer: int) -> None:
    """Before n_layer sizes anything: every layer needs `per_layer` tensors of the file's."""
    if n_layer * per_layer > n_tensors:
        raise GGUFError(f"the GGUF claims {n_layer} layers but holds only {n_tensors} tensors "
                        f"({per_layer} per layer needed)")


def rope_positions(n_ctx_train: int, serving: int = SERVING_POSITIONS) -> int:
    """The rope tables' length: the trained context, capped at what serving can reach."""
    if n_ctx_train > MAX_CONTEXT_CLAIM:
        raise GGUFError(f"the GGUF claims a context of {n_ctx_train:,} tokens, past any trained model's "
                        f"(at most {MAX_CONTEXT_CLAIM:,} accepted); the file is broken")
    return min(n_ctx_train, serving)


def _dims(shape) -> tuple[int, ...]:
    """ggml's dimension order (ne0 = a row's length first), without trailing 1s some writers add."""
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def expected_shapes(spec: "ModelSpec", names: set[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor the converter reads, with the shape (ggml order) the metadata implies."""
    e, f, v = spec.n_embd, spec.n_ff, spec.n_vocab
    q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (e, v), "output_norm.weight": (e,)}
    if "output.weight" in names:
        want["output.weight"] = (e, v)
    if spec.rope_freqs:
        want["rope_freqs.weight"] = (spec.head_dim // 2,)
    layer = {"attn_norm": (e,), "ffn_norm": (e,), "attn_q": (e, q), "attn_k": (e, kv), "attn_v": (e, kv),
             "attn_output": (q, e), "ffn_gate": (e, f), "ffn_up": (e, f), "ffn_down": (f, e)}
    bias = {"q": (q,), "k": (kv,), "v": (kv,)} if spec.qkv_bias else {}
    for i in range(spec.n_layer):
        want.update({f"blk.{i}.{name}.weight": shape for name, shape in layer.items()})
        want.update({f"blk.{i}.attn_{x}.bias": shape for x, shape in bias.items()})
    return want


def check_shapes(reader, spec: "ModelSpec") -> None:
    """GGUFError naming the first tensor whose shape disagrees with the metadata's layout."""
    tensors = {t.name: t for t in reader.tensors}
    for name, want in expected_shapes(spec, set(tensors)).items():
        got = _dims(tensors[name].shape)
        if got != want:
            raise GGUFError(
                f"the GGUF's metadata disagrees with its tensors: {name} is {'x'.join(map(str, got))}, its "
                f"layout (width {spec.n_embd}, {spec.n_head} heads, {spec.n_head_kv} kv heads of size "
                f"{spec.head_dim}, feed-forward {spec.n_ff}) needs {'x'.join(map(str, want))}")


def check_vocab(reader, spec: "ModelSpec") -> None:
    """The vocabulary the metadata and the tokenizer state must be the embedding table's rows."""
    claimed = reader.fields.get(f"{spec.arch}.vocab_size")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    for what, n in (("vocab_size", claimed.contents() if claimed is not None else None),
                    ("tokenizer's token count", len(tokens.data) if tokens is not None else None)):
        if n is not None and n != spec.n_vocab:
            raise GGUFError(f"the GGUF's {what} ({str(n)[:20]}) disagrees with its embedding table "
                            f"({spec.n_vocab} rows)")


def peak_bytes(spec: "ModelSpec") -> int:
    """About the most memory the conversion holds at once: weights.py prepares one array at a
    time (the widest: the embedding table or LM head, a layer's q/k/v or gate/up stack), and the
    rope tables are built whole."""
    widest = max(spec.n_vocab * spec.n_embd,
                 spec.n_embd * (spec.n_head + 2 * spec.n_head_kv) * spec.head_dim,
                 spec.n_embd * 2 * spec.n_ff)
    return max(widest * _PREPARED_COPIES_BYTES, spec.n_positions * (spec.head_dim // 2) * _ROPE_BYTES)


def check_memory(spec: "ModelSpec", available: int | None = None) -> None:
    """ConversionMemoryError when the conversion's peak would not fit the memory available now."""
    available = psutil.virtual_memory().available if available is None else available
    need = peak_bytes(spec)
    if need > available * _MEMORY_SHARE:
        raise ConversionMemoryError(f"converting this model needs about {need / 2**30:.1f} GiB of memory at once; "
                                    f"{available / 2**30:.1f} GiB is available")
