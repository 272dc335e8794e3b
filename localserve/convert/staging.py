"""Writing a model folder so that it appears whole or not at all.

Everything is written into a hidden sibling that is renamed into place last and removed on any
error or interrupt (Ctrl-C included), so a reader never sees half a conversion. Shared by both
converters (the packed ONNX folder and the onnxruntime-genai folder).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import onnx


@contextmanager
def staged_folder(out_dir: Path) -> Iterator[Path]:
    """Yields the hidden folder to write into; on a clean exit it becomes `out_dir`."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir.name} already exists")
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def write_graphs(folder: Path, graphs: dict[str, onnx.ModelProto], weights, data_file: str,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Stream the weights every graph named into `data_file`, then write each graph pointing at it."""
    from .weights import write_external

    initializers = write_external(weights, folder / data_file, progress)
    for name, model in graphs.items():
        model.graph.initializer.extend(initializers)
        with open(folder / name, "wb") as f:
            f.write(model.SerializeToString())
