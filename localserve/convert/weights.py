"""The graph's initializers, prepared from GGUF tensors and streamed into one external-data file.

Each weight is dequantized to float32 (gguf's numpy reference, bit-for-bit what llama.cpp computes
before its own matmul rounding), rearranged for the graph (MatMul weights transposed to [in, out];
q/k/v and gate/up concatenated so each layer runs two wide matmuls instead of five narrow ones),
and written straight to `model.onnx.data` one tensor at a time: the ModelProto holds only offsets,
so peak memory is one layer, not a second copy of the model inside protobuf.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
from onnx import TensorProto

from .graph import rope_tables
from .spec import ModelSpec, tensor_f32

_ALIGN = 64  # onnxruntime may memory-map the data file; aligned offsets keep every tensor aligned


class WeightSource:
    """Maps the graph's weight names to arrays built from the GGUF's tensors."""

    def __init__(self, reader, spec: ModelSpec) -> None:
        self.spec = spec
        self._tensors = {t.name: t for t in reader.tensors}
        self.names: list[str] = []  # in the order the graph asked for them

    def name(self, key: str) -> str:
        """The initializer name for `key` (the graph builder's callback); tied heads reuse the embedding."""
        if key == "output" and self.spec.tied_embeddings:
            key = "token_embd"
        if key not in self.names:
            self.names.append(key)
        return key

    def _t(self, name: str) -> np.ndarray:
        return tensor_f32(self._tensors[name])

    def array(self, key: str) -> np.ndarray:
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
        if part == "attn_qkv":
            return np.concatenate([self._t(p + f"attn_{x}.weight") for x in "qkv"]).T
        if part == "attn_qkv.bias":
            return np.concatenate([self._t(p + f"attn_{x}.bias").ravel() for x in "qkv"])
        if part == "ffn_gate_up":
            return np.concatenate([self._t(p + "ffn_gate.weight"), self._t(p + "ffn_up.weight")]).T
        if part in ("attn_output", "ffn_down"):
            return self._t(p + part + ".weight").T
        raise KeyError(key)


def write_external(source: WeightSource, data_path: Path,
                   progress: Callable[[int, int], None] | None = None) -> list[TensorProto]:
    """Write every weight the graph named into `data_path`; TensorProtos that point into it."""
    protos: list[TensorProto] = []
    total = len(source.names)
    with open(data_path, "wb") as f:
        for done, key in enumerate(source.names, 1):
            protos.append(_write_one(f, key, np.ascontiguousarray(source.array(key), dtype=np.float32),
                                     data_path.name))
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
    proto = TensorProto(name=key, data_type=TensorProto.FLOAT, dims=arr.shape)
    proto.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(arr.nbytes))):
        entry = proto.external_data.add()
        entry.key, entry.value = k, v
    return proto
