"""Convert an installed model's GGUF into the tag's `onnx` (or, with --oga, `oga`) variant in the store.

The conversion writes into a staging folder under the store's `.tmp` (same filesystem), and the
store's own `add_directory` checks, checksums and renames it into the tag before the manifest
names it; the staging folder goes away on success, error or Ctrl-C. So an interrupted conversion
leaves no variant behind, and a refused one (unsupported architecture or tensor type) costs nothing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from ..errors import ModelNotFoundError
from ..store.cache import InstalledModel, ModelStore
from . import check_convertible, convert_gguf


def convert_installed(store: ModelStore, model: InstalledModel,
                      progress: Callable[[int, int], None] | None = None, *, oga: bool = False,
                      **flavour: Any) -> InstalledModel:
    """`model` with an `onnx` variant converted from its GGUF (refusals before any work); `flavour`
    holds convert_gguf's flavour options (flavour="static", static_tokens, static_slots). `oga`:
    an onnxruntime-genai folder instead (convert/oga.py; of the options only `weights` applies),
    stored as the tag's `oga` variant."""
    gguf = model.gguf
    if gguf is None or not gguf.available:
        raise ModelNotFoundError(model.ref, message=f"model {model.ref} has no GGUF file to convert; pull it first")
    from ..store.model_dirs import remove_tree
    from .oga import check_oga_convertible, convert_gguf_oga

    (check_oga_convertible if oga else check_convertible)(gguf.path)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=store.tmp_dir()))
    try:
        if oga:
            convert_gguf_oga(gguf.path, staging / "oga", progress=progress, weights=flavour.get("weights") or "fp32")
        else:
            convert_gguf(gguf.path, staging / "onnx", gguf_sha256=gguf.sha256, progress=progress, **flavour)
        return store.add_directory(staging / ("oga" if oga else "onnx"), model.name, model.tag)
    finally:
        remove_tree(staging)
