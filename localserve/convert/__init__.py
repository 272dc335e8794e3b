"""GGUF -> ONNX for the ONNX Runtime backend: our own code on onnx + gguf + numpy.

`convert_gguf` refuses what it cannot convert before any work (spec.py), builds the packed decoder
graph (graph.py), streams the weights into `model.onnx.data` (weights.py) and writes the folder
the store's `onnx` variant requires (model_dirs.py: `model.onnx` + `localserve-onnx.json`).
The folder appears whole or not at all: everything is written into a hidden sibling that is renamed
into place last and removed on any error or interrupt (Ctrl-C included).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from .spec import SUPPORTED_ARCHS, SUPPORTED_TYPES, ModelSpec, UnsupportedModelError, open_reader, read_spec

# Bump when the graph or its inputs change: cached conversions keyed by it are then redone.
CONVERTER_VERSION = 2  # 2: the embeddings output
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
META_FILE = "localserve-onnx.json"
META_VERSION = 1  # model_dirs.ONNX_META_VERSION

__all__ = ["CONVERTER_VERSION", "SUPPORTED_ARCHS", "SUPPORTED_TYPES", "ModelSpec", "UnsupportedModelError",
           "convert_gguf", "check_convertible"]


def check_convertible(gguf_path: Path) -> ModelSpec:
    """The model's spec, or UnsupportedModelError / GGUFError: no work done, nothing written."""
    return read_spec(open_reader(gguf_path))


def convert_gguf(gguf_path: Path, out_dir: Path, *, gguf_sha256: str | None = None,
                 flavour: str = "dynamic", static_tokens: int = 64, static_slots: int = 1024,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Convert `gguf_path` into the new folder `out_dir`; returns its localserve-onnx.json.

    flavour "dynamic": T, S and R are free (the packed graph); "static": T = static_tokens tokens
    per run (padded by the caller), S = static_slots KV rows and R = T, every shape fixed."""
    from .graph import Dims, build_graph
    from .weights import WeightSource, write_external

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if flavour not in ("dynamic", "static"):
        raise ValueError(f"flavour must be 'dynamic' or 'static' (got {flavour!r})")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir.name} already exists")
    reader = open_reader(gguf_path)
    spec = read_spec(reader)  # every refusal happens here, before any work
    if gguf_sha256 is None:
        from ..pull.verify import sha256_file

        gguf_sha256 = sha256_file(gguf_path)
    dims = Dims() if flavour == "dynamic" else Dims(static_tokens, static_slots, static_tokens)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        weights = WeightSource(reader, spec)
        model = build_graph(spec, weights.name, dims)
        model.graph.initializer.extend(write_external(weights, partial / DATA_FILE, progress))
        with open(partial / MODEL_FILE, "wb") as f:
            f.write(model.SerializeToString())
        meta = _meta(spec, gguf_path, gguf_sha256, flavour, dims)
        (partial / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _meta(spec: ModelSpec, gguf_path: Path, sha: str, flavour: str, dims) -> dict[str, Any]:
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
        "static": None if flavour == "dynamic" else {"tokens": dims.tokens, "slots": dims.slots},
        "context_length": spec.n_ctx_train,
        "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head": spec.n_head, "n_head_kv": spec.n_head_kv,
        "head_dim": spec.head_dim, "n_vocab": spec.n_vocab, "n_params": n_params,
        "weights": "float32",
    }
