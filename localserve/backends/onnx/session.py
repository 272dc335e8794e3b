"""What both flavours of the ONNX backend open a folder with: its metadata, onnxruntime sessions
with the CPU as the fallback EP, the KV caches bound in place, and llama.cpp's tokenizer.

Apart from backend.py so the static flavour (a subclass of the dynamic backend) and the embedder
take these without importing each other in a circle.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from ...errors import BackendError
from ..llamacpp.vocab import LlamaVocab

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
META_FILE = "localserve-onnx.json"
CPU_EP = "CPUExecutionProvider"


def read_meta(model_dir: Path) -> dict:
    try:
        meta = json.loads((model_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BackendError(f"the ONNX folder's {META_FILE} cannot be read ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("flavour") not in ("dynamic", "static"):
        flavour = meta.get("flavour") if isinstance(meta, dict) else None
        raise BackendError(f"the ONNX folder is not an export of localserve convert "
                           f"(flavour: {flavour or 'none'}); convert the model again")
    return meta


def open_session(path: Path, n_threads: int, providers: Sequence[str], shared: dict | None = None,
                 prepack: bool = False):
    """An onnxruntime session for one graph file; BackendError (no host path) when it cannot load.
    `shared`: initializer name -> OrtValue used in place of the file's (onnx_static.shared_weights),
    unpacked unless `prepack`."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    for name, value in (shared or {}).items():
        opts.add_initializer(name, value)
    if shared and not prepack:  # prepacking would give each session its own packed copy of every weight
        opts.add_session_config_entry("session.disable_prepacking", "1")
    opts.intra_op_num_threads = n_threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # ORT warns about every unused initializer: noise in our logs
    try:
        return ort.InferenceSession(str(path), opts, providers=list(providers))
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types with paths inside
        if len(providers) > 1 and providers[-1] == CPU_EP:
            # An EP that is installed but fails to start (a DirectML adapter the driver rejects,
            # an NPU runtime that is missing a library) must not cost the model: the CPU runs it.
            log.warning("%s failed to initialise for %s (%s); running on the CPU EP", providers[0], path.name, e)
            return open_session(path, n_threads, [CPU_EP], shared, prepack)
        log.warning("onnxruntime could not load %s: %s", path.name, e)
        raise BackendError(f"onnxruntime could not load the ONNX model in {path.parent.name!r} "
                           f"({type(e).__name__})") from None


def bind_caches(io, caches: Sequence) -> None:
    """Bind each layer's key and value cache (in that order in `caches`) as input and output."""
    for n, cache in enumerate(caches):
        name = f"{n // 2}.{('key', 'value')[n % 2]}"
        # The same buffer in and out: ScatterElements writes this step's rows into it in place.
        io.bind_ortvalue_input(f"cache.{name}", cache)
        io.bind_ortvalue_output(f"cache_out.{name}", cache)


def open_vocab(gguf_path: str | os.PathLike[str], meta: dict) -> LlamaVocab:
    return LlamaVocab(gguf_path, n_ctx_train=int(meta["context_length"]), n_embd=int(meta["n_embd"]),
                      n_params=int(meta.get("n_params", 0)))
