"""GGUF -> ONNX for the ONNX Runtime backend: our own code on onnx + gguf + numpy.

`convert_gguf` refuses what it cannot convert before any work (spec.py), builds the packed decoder
graph (graph.py), streams the weights into `model.onnx.data` (weights.py) and writes the folder
the store's `onnx` variant requires (model_dirs.py: `model.onnx` + `localserve-onnx.json`).
The folder appears whole or not at all (staging.py). `--oga` writes an onnxruntime-genai folder
instead (oga.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

from .bounds import SERVING_POSITIONS
from .spec import SUPPORTED_ARCHS, SUPPORTED_TYPES, ModelSpec, UnsupportedModelError, open_reader, read_spec

# Bump when the graph or its inputs change: cached conversions keyed by it are then redone.
CONVERTER_VERSION = 3  # 2: the embeddings output; 3: weights int4/int8 (MatMulNBits) or fp32
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
META_FILE = "localserve-onnx.json"
META_VERSION = 1  # model_dirs.ONNX_META_VERSION
# The static flavour's token buckets: a decode of one sequence runs the 1-token graph, up to 16
# decoders the 16-token one, prompts go through 64 at a time, so no step pays for far more padding
# rows than it has tokens (backends/onnx_static.py picks the bucket per run).
STATIC_BUCKETS = (1, 16, 64)

# Execution providers with a com.microsoft.MatMulNBits kernel (research notes §3.5: CPU ran it, DirectML
# has DmlOperatorMatMulNBits, QNN lists it; CUDA ships the contrib kernel). The others (OpenVINO,
# VitisAI, CoreML, MIGraphX...) are not known to: they get float weights, not a graph they might
# hand back to the CPU node by node.
WEIGHTS = ("int4", "int8", "fp32")  # convert_gguf's `weights`, the CLI's --weights
NBITS_PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider", "QNNExecutionProvider")

__all__ = ["CONVERTER_VERSION", "NBITS_PROVIDERS", "STATIC_BUCKETS", "SUPPORTED_ARCHS", "SUPPORTED_TYPES", "WEIGHTS",
           "ModelSpec", "UnsupportedModelError", "convert_gguf", "check_convertible", "default_weights",
           "static_buckets"]


def default_weights(execution_provider: str | None, matmul_types: Collection[str] = ()) -> str:
    """The weights a conversion gets unless asked: MatMulNBits blocks only where the GGUF's own
    codes carry over as they are (all matmul weights Q4_0: "int4", all Q8_0: "int8") and the EP
    (None: the CPU's) runs MatMulNBits; "fp32" otherwise.

    Re-quantizing costs llama.cpp's answers, measured on SmolLM2 Q4_1 (CPU EP, first 8 greedy
    tokens on 8 prompts, tests/model/test_convert_nbits.py): fp32 kept 7, int8 6 (8 with float
    activations, which run 10-40x slower), int4 1 (Q4_1's offsets are on no 4-bit grid with
    integer zero points). So a re-quantized form is there to ask for (`--weights`: int8 is 227
    MiB against fp32's 515), not the default the issue's parity bar is held to."""
    if (execution_provider or "CPUExecutionProvider") not in NBITS_PROVIDERS:
        return "fp32"
    kinds = set(matmul_types)
    only = next(iter(kinds)) if len(kinds) == 1 else None
    return {"Q4_0": "int4", "Q8_0": "int8"}.get(only, "fp32")


def check_convertible(gguf_path: Path) -> ModelSpec:
    """The model's spec, or UnsupportedModelError / GGUFError: no work done, nothing written."""
    return read_spec(open_reader(gguf_path))


def convert_gguf(gguf_path: Path, out_dir: Path, *, gguf_sha256: str | None = None,
                 flavour: str = "dynamic", static_tokens: int | Sequence[int] = STATIC_BUCKETS,
                 static_slots: int = 1024, weights: str | None = None, execution_provider: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Convert `gguf_path` into the new folder `out_dir`; returns its localserve-onnx.json.

    weights "int4" / "int8": matmul weights as 4- / 8-bit MatMulNBits blocks (nbits.py); "fp32":
    dequantized; None: default_weights for `execution_provider` (the EP the folder will run on)
    and the GGUF's matmul weight types.

    flavour "dynamic": T, S and R are free (the packed graph in model.onnx); "static": one graph per
    bucket T in `static_tokens` (T tokens per run, padded by the caller; R = T logits rows), each
    with static_slots KV slots plus one sink row for the padding (backends/onnx_static.py), every
    shape fixed. The largest bucket's graph is model.onnx, the others model.t<T>.onnx; all of them
    read the one weights file."""
    from .graph import Dims, build_graph
    from .staging import staged_folder, write_graphs
    from .weights import WeightSource

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if flavour not in ("dynamic", "static"):
        raise ValueError(f"flavour must be 'dynamic' or 'static' (got {flavour!r})")
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} (got {weights!r})")
    buckets = static_buckets(static_tokens, static_slots) if flavour == "static" else ()
    if out_dir.exists():
        raise FileExistsError(f"{out_dir.name} already exists")
    reader = open_reader(gguf_path)
    # Every refusal happens here, before any work. A static pool fixes the positions it reaches.
    spec = read_spec(reader, max(SERVING_POSITIONS, static_slots) if buckets else SERVING_POSITIONS)
    if weights is None:
        from .weights import matmul_types

        weights = default_weights(execution_provider, matmul_types(reader))
    if gguf_sha256 is None:
        from ..store.verify import sha256_file

        gguf_sha256 = sha256_file(gguf_path)
    with staged_folder(out_dir) as partial:
        source = WeightSource(reader, spec, weights)
        if flavour == "dynamic":
            graphs = {MODEL_FILE: build_graph(spec, source.name, Dims(), source.nbits)}
        else:  # S + 1 cache rows: the last is the sink the padding rows write into
            graphs = {static_graph_file(t, buckets): build_graph(spec, source.name, Dims(t, static_slots + 1, t),
                                                                 source.nbits)
                      for t in buckets}
        write_graphs(partial, graphs, source, DATA_FILE, progress)
        static = {"tokens": list(buckets), "slots": static_slots, "sink_rows": 1,
                  "graphs": {str(t): static_graph_file(t, buckets) for t in buckets}} if buckets else None
        meta = _meta(spec, gguf_path, gguf_sha256, flavour, static, source.describe())
        (partial / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return meta


def static_graph_file(tokens: int, buckets: Sequence[int]) -> str:
    """The largest bucket's graph is model.onnx, the file every onnx folder must hold."""
    return MODEL_FILE if tokens == max(buckets) else f"model.t{tokens}.onnx"


def static_buckets(tokens: int | Sequence[int], slots: int) -> tuple[int, ...]:
    """The static flavour's buckets, sorted; ValueError naming the bad value."""
    buckets = tuple(sorted({tokens} if isinstance(tokens, int) else set(tokens)))
    if not buckets or any(not isinstance(t, int) or t < 1 for t in buckets):
        raise ValueError(f"static_tokens must be positive token counts (got {tokens!r})")
    if not isinstance(slots, int) or slots < max(buckets):
        raise ValueError(f"static_slots must be at least the largest bucket ({max(buckets)}; got {slots!r})")
    return buckets


def _meta(spec: ModelSpec, gguf_path: Path, sha: str, flavour: str,
          static: dict[str, Any] | None, weights: dict[str, Any]) -> dict[str, Any]:
    n_params = spec.n_layer * (spec.n_embd * (spec.n_head + 2 * spec.n_head_kv) * spec.head_dim
                               + spec.n_embd * spec.n_embd + 3 * spec.n_embd * spec.n_ff + 2 * spec.n_embd)
    n_params += spec.n_vocab * spec.n_embd * (1 if spec.tied_embeddings else 2) + spec.n_embd
    return {
        "localserve_onnx": META_VERSION,
        "architecture": spec.arch,
        # llama.cpp's tokenizer: a vocab-only load of the GGUF with this digest (the tag's gguf variant).
        "tokenizer": {"gguf_sha256": sha},
        "source": {"file": gguf_path.name, "gguf_sha256": sha},
        "converter_version": CONVERTER_VERSION,
        "flavour": flavour,
        "static": static,
        # The positions the rope tables cover (the backend's max_pos); the trained context only
        # when that is longer, so a folder from a sane GGUF is what it was before the bound.
        "context_length": spec.n_positions,
        **({"trained_context_length": spec.n_ctx_train} if spec.n_ctx_train != spec.n_positions else {}),
        "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head": spec.n_head, "n_head_kv": spec.n_head_kv,
        "head_dim": spec.head_dim, "n_vocab": spec.n_vocab, "n_params": n_params,
        **weights,
    }
