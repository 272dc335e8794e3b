"""`localserve convert MODEL[:TAG]`: turn an installed GGUF into the tag's ONNX variant (offline)."""

from __future__ import annotations

import argparse

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import Settings
from ..store import ModelStore


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("convert", parents=[common],
                              help="convert an installed GGUF model to ONNX for the onnx backend")
    p.add_argument("model", help="NAME[:TAG] of an installed model")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace, settings: Settings) -> int:
    from ..convert.install import convert_installed

    store = ModelStore(settings)
    model = store.find(args.model)
    columns = (TextColumn("converting {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tensors"), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(model.ref, total=None)
        model = convert_installed(store, model, lambda done, total: bar.update(task, completed=done, total=total))
    v = model.variants["onnx"]
    print(f"converted {model.ref}: onnx variant ({len(v.files)} files, {v.size / 2**20:.0f} MiB, "
          f"sha256 {(v.sha256 or '?')[:12]}…)")
    return 0
