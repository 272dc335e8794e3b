"""`localserve convert MODEL[:TAG]`: turn an installed GGUF into the tag's ONNX (or, with --oga,
onnxruntime-genai) variant (offline)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config.settings import Settings
from ..errors import ConfigError, LocalserveError
from ..store.cache import ModelStore


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("convert", parents=[common],
                              help="convert an installed GGUF model to ONNX for the onnx backend")
    p.add_argument("model", help="NAME[:TAG] of an installed model")
    p.add_argument("--oga", action="store_true",
                   help="write an onnxruntime-genai folder (served by OGA's own engine; the onnx-genai extra)")
    p.add_argument("--static", action="store_true",
                   help="fixed shapes for NPU execution providers (default: the dynamic packed graph)")
    p.add_argument("--static-tokens", default="1,16,64", metavar="T,T,..",
                   help="with --static: token buckets, one graph each (default 1,16,64)")
    p.add_argument("--static-slots", type=int, default=1024, metavar="S",
                   help="with --static: KV slots of all sequences together (default 1024)")
    from ..convert import WEIGHTS

    p.add_argument("--weights", choices=WEIGHTS, default=None,
                   help="int4 / int8: matmul weights as 4- / 8-bit MatMulNBits blocks; fp32: dequantized "
                        "(default: the GGUF's own codes where they carry over, all Q4_0 as int4 or all Q8_0 "
                        "as int8, on an execution provider with MatMulNBits; else fp32)")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace, settings: Settings) -> int:
    from ..convert.install import convert_installed

    store = ModelStore(settings)
    if args.oga and args.static:
        raise ConfigError("--oga and --static are different outputs; choose one")
    # An OGA folder is fp32 unless asked: on SmolLM2 the int4 one (re-quantized Q4_1) differed from
    # llama.cpp within 8 greedy tokens on 8 of 8 prompts (fp32: 1 of 8) and decoded no faster
    # through OGA's engine here (23 vs 34 tok/s at batch 1, a shared 2-core machine).
    flavour = {"oga": True, "weights": args.weights or "fp32"} if args.oga else _flavour(args)
    model = store.find(args.model)
    with conversion_bar(model.ref) as progress:
        model = convert_installed(store, model, progress, **flavour)
    kind = "oga" if args.oga else "onnx"
    v = model.variants[kind]
    print(f"converted {model.ref}: {kind} variant ({len(v.files)} files, {v.size / 2**20:.0f} MiB, "
          f"sha256 {(v.sha256 or '?')[:12]}…)")
    return 0


@contextlib.contextmanager
def conversion_bar(ref: str, console: Console | None = None) -> Iterator[Callable[[int, int], None]]:
    """A progress bar over the converted tensors; yields the converter's progress callback."""
    columns = (TextColumn("converting {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tensors"), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=console) as bar:
        task = bar.add_task(ref, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _execution_provider() -> str | None:
    """The EP placement gives an ONNX model on this machine: the default weights are its (convert_gguf)."""
    from ..hardware import detect_hardware
    from ..runtime.placement import choose_backend

    try:
        return choose_backend(detect_hardware(), ["onnx"], prefer="onnx").execution_provider
    except LocalserveError:  # onnxruntime not installed: the CPU's choice, like a load would fall back to
        return None


def _flavour(args: argparse.Namespace) -> dict:
    """convert_gguf's flavour options from the flags; ConfigError for bad buckets, before any work."""
    from ..convert import static_buckets

    weights = {"weights": args.weights} if args.weights else {"execution_provider": _execution_provider()}
    if not args.static:
        return weights
    try:
        tokens = tuple(int(t) for t in args.static_tokens.split(","))
        static_buckets(tokens, args.static_slots)
    except ValueError as e:
        raise ConfigError(f"--static-tokens/--static-slots: {e}") from None
    return {"flavour": "static", "static_tokens": tokens, "static_slots": args.static_slots, **weights}
