"""The graph's initializers, prepared from GGUF tensors and streamed into one external-data file.

With weights "fp32" each weight is dequantized to float32 (gguf's numpy reference, bit-for-bit what
llama.cpp computes before its own matmul rounding) and MatMul weights are transposed to [in, out].
With "int4" / "int8" the matmul weights become 4- / 8-bit MatMulNBits blocks instead (nbits.py);
norms, rope tables and the token embedding (a Gather) stay float32. Either way q/k/v and
gate/up are concatenated, so each layer runs two wide matmuls instead of five narrow ones, and each
tensor goes straight to `model.onnx.data`: the ModelProto holds only offsets, so peak memory is
one layer, not a second copy of the model inside protobuf.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
from onnx import TensorProto

from .graph import rope_tables
from .nbits import Layout, Packed, layout_for, pack
from .spec import ModelSpec, tensor_f32

_ALIGN = 64  # onnxruntime may memory-map the data file; aligned offsets keep every tensor aligned
_DTYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.uint8): TensorProto.UINT8}
# The matmul weights, by the graph's name for them: the GGUF tensors stacked along N.
_MATMULS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up"),
            "attn_output": ("attn_output",), "ffn_down": ("ffn_down",)}


def matmul_types(reader) -> set[str]:
    """The GGUF types of the layers' matmul weights (what default_weights decides on)."""
    parts = {t for names in _MATMULS.values() for t in names}
    return {t.tensor_type.name for t in reader.tensors
            if t.name.startswith("blk.") and t.name.endswith(".weight") and t.name.split(".")[2] in parts}


class WeightSource:
    """Maps the graph's weight names to arrays built from the GGUF's tensors."""

    def __init__(self, reader, spec: ModelSpec, weights: str = "fp32") -> None:
        """`weights`: "int4", "int8" or "fp32" (convert_gguf checked it)."""
        self.spec, self.weights = spec, weights
        self._bits = {"int4": 4, "int8": 8}.get(weights)  # None: float32
        self._tensors = {t.name: t for t in reader.tensors}
        self.names: list[str] = []  # in the order the graph asked for them
        self._packed: tuple[str, Packed] | None = None  # the last packed weight: its parts come in a row
        self._layouts: dict[str, str] = {}  # matmul weight -> how it is stored, for describe()

    def name(self, key: str) -> str:
        """The initializer name for `key` (the graph builder's callback); a tied float head reuses
        the embedding table."""
        if key == "output" and self.spec.tied_embeddings:
            key = "token_embd"
        if key not in self.names:
            self.names.append(key)
        return key

    def nbits(self, key: str) -> Layout | None:
        """The graph builder's callback: the MatMulNBits layout of matmul weight `key`, None: float.

        A tied LM head stays the float32 embedding table: the Gather needs that table anyway, and
        a packed copy (+31 MiB for SmolLM2's Q8_0 as 8-bit) measured no faster on the CPU EP
        (49152x576, 2 threads: fp32 Gemm 3.3 ms for 1 row, 16 ms for 16; 8-bit blocks 4.7 / 24 ms).
        An untied head is packed like any matmul: its float copy would be the only one."""
        layout = None
        if self._bits and (key != "output" or not self.spec.tied_embeddings):
            layout = layout_for([self._tensors[n].tensor_type.name for n in self._parts(key)], self._bits)
        self._layouts[key] = layout.describe() if layout else "float32"
        return layout

    def describe(self) -> dict[str, Any]:
        """localserve-onnx.json's account of the weights: the option, how many matmul weights took
        each form, and the LM head's (the token embedding is always a float32 table)."""
        layouts = dict(self._layouts)
        head = layouts.pop("output", "float32")
        if head == "float32" and self.spec.tied_embeddings:
            head = "float32, the token embedding table itself"
        return {"weights": self.weights, "matmul_weights": dict(Counter(layouts.values())),
                "lm_head": head, "token_embedding": "float32"}

    def _parts(self, key: str) -> list[str]:
        """The GGUF tensors a matmul weight stacks along N."""
        if key == "output":
            return ["token_embd.weight" if self.spec.tied_embeddings else "output.weight"]
        block, _, part = key.partition(".")[2].partition(".")
        return [f"blk.{block}.{t}.weight" for t in _MATMULS[part]]

    def _t(self, name: str) -> np.ndarray:
        return tensor_f32(self._tensors[name])

    def array(self, key: str) -> np.ndarray:
        base, _, field = key.rpartition(".")
        if field in ("codes", "scales", "zero_points"):
            if self._packed is None or self._packed[0] != base:
                self._packed = (base, pack([self._tensors[n] for n in self._parts(base)], self._bits, tensor_f32))
            return getattr(self._packed[1], field)
        if key in ("token_embd", "output", "output_norm"):
            return self._t(f"{key}.weight")
        if key.startswith("rope."):
            factors = self._t("rope_freqs.weight") if self.spec.rope_freqs else None
            cos, sin = rope_tables(self.spec, factors)
            return cos if key == "rope.cos" else sin
        block, _, part = key.partition(".")[2].partition(".")
        p = f"blk.{block}."
        if part in ("attn_norm", "ffn_norm"):
            return self._t(p + part + ".weight")
        if part == "attn_qkv.bias":
            return np.concatenate([self._t(p + f"attn_{x}.bias").ravel() for x in "qkv"])
        if part in _MATMULS:
            return np.concatenate([self._t(n) for n in self._parts(key)]).T
        raise KeyError(key)


def write_external(source: WeightSource, data_path: Path,
                   progress: Callable[[int, int], None] | None = None) -> list[TensorProto]:
    """Write every weight the graph named into `data_path`; TensorProtos that point into it."""
    protos: list[TensorProto] = []
    total = len(source.names)
    with open(data_path, "wb") as f:
        for done, key in enumerate(source.names, 1):
            protos.append(_write_one(f, key, np.ascontiguousarray(source.array(key)), data_path.name))
            if progress is not None:
                progress(done, total)
    return protos


def _write_one(f: BinaryIO, key: str, arr: np.ndarray, location: str) -> TensorProto:
    offset = f.tell()
    pad = -offset % _ALIGN
    if pad:
        f.write(b"\0" * pad)
        offset += pad
    f.write(memoryview(arr).cast("B"))
    proto = TensorProto(name=key, data_type=_DTYPES[arr.dtype], dims=arr.shape)
    proto.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(arr.nbytes))):
        entry = proto.external_data.add()
        entry.key, entry.value = k, v
    return proto
