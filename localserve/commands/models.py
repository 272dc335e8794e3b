"""`localserve pull / list / show / rm / add`: the model cache from the terminal (offline commands,
no daemon needed)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ..store.catalog import parse_ref
from ..config.settings import Settings
from ..errors import InvalidRequestError
from ..pull import PullEvent, pull_model
from ..runtime.describe import describe_model, summary
from ..store.cache import ModelStore
from ..store.projector import kinds


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("pull", parents=[common], help="download a model (name[:tag], hf.co/ORG/REPO[:QUANT], or URL)")
    p.add_argument("model", help="e.g. smollm2-135m, qwen2.5-1.5b:Q4_K_M, hf.co/ORG/REPO:Q4_K_M, https://.../x.gguf")
    p.set_defaults(func=run_pull)

    p = subparsers.add_parser("list", aliases=["ls"], parents=[common], help="list installed models")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_list)

    p = subparsers.add_parser("show", parents=[common], help="details of an installed model")
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=None, help="context length for the memory estimate")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_show)

    p = subparsers.add_parser("rm", parents=[common], help="remove installed models")
    p.add_argument("models", nargs="+", metavar="MODEL")
    p.set_defaults(func=run_rm)

    p = subparsers.add_parser("cache", parents=[common], help="the prompt cache on disk: `cache clear` deletes it")
    p.add_argument("action", choices=["clear", "info"])
    p.set_defaults(func=run_cache)

    p = subparsers.add_parser("add", parents=[common],
                              help="register a GGUF file you already have (in place, no copy), or copy in an "
                                   "ONNX (model.onnx + localserve-onnx.json) or onnxruntime-genai (genai_config.json) folder")
    p.add_argument("path", help="a .gguf file or a model folder")
    p.add_argument("--name", required=True, help="NAME[:TAG] to register it under")
    p.add_argument("--mmproj", metavar="FILE", default=None,
                   help="the model's vision projector (an mmproj .gguf), registered in place with it")
    p.add_argument("--lora", metavar="FILE", action="append", default=[],
                   help="a LoRA adapter (.gguf) for the model, registered in place with it; repeatable (ids 0, 1, ...)")
    p.set_defaults(func=run_add)


# -- pull -----------------------------------------------------------------------------------

class PullDisplay:
    """Renders PullEvents: one progress row per part (bytes, speed, ETA), status lines otherwise."""

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.tasks: dict[tuple[str, str], TaskID] = {}
        self.last_status: str | None = None

    def __call__(self, event: PullEvent) -> None:
        if event.part is not None and event.completed is not None:
            kind = "verifying" if event.status.startswith("verifying") else "pulling"
            key = (kind, event.part)
            task = self.tasks.get(key)
            if task is None:
                # Start at the resumed offset, so the speed column measures this session's bytes only.
                if not self.tasks:
                    self.progress.start()  # lazily: no empty live area when nothing downloads
                task = self.progress.add_task(f"{kind} {event.part}", total=event.total, completed=event.completed)
                self.tasks[key] = task
            self.progress.update(task, completed=event.completed, total=event.total)
            return
        if event.status != self.last_status:
            self.last_status = event.status
            self.progress.console.print(event.status if event.part is None else f"{event.status} {event.part}")

    def __enter__(self) -> "PullDisplay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def run_pull(args: argparse.Namespace, settings: Settings) -> int:
    console = Console(stderr=True)
    display = PullDisplay(console)
    try:
        with display:
            model = pull_model(args.model, settings, progress=display)
    except KeyboardInterrupt:
        console.print(f"Interrupted. The partial download is kept: run `localserve pull {args.model}` to resume.")
        return 130
    Console().print(f"{model.ref} ready ({_size(model.size)}, sha256 {(model.sha256 or '?')[:12]}…)")
    return 0


# -- list -----------------------------------------------------------------------------------

def run_list(args: argparse.Namespace, settings: Settings) -> int:
    models = ModelStore(settings).list()
    remote = [(alias, u.name) for u in settings.upstreams for alias in u.config_names()]
    if args.json:
        print(json.dumps([summary(m) for m in models]
                         + [{"model": alias, "remote": True, "upstream": up} for alias, up in remote], indent=2))
        return 0
    for alias, up in remote:  # served by an upstream (`localserve upstream list`), nothing on disk
        Console().print(f"{alias}  remote ({up})")
    if not models:
        Console().print(f"No models installed. Try `localserve pull {settings.default_model}`.")
        return 0
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "TAG", "SIZE", "QUANT", "VARIANTS", "MODIFIED"):
        table.add_column(column, justify="right" if column == "SIZE" else "left")
    for m in models:
        name = m.name + ("" if m.available else " (file missing)")
        table.add_row(name, m.tag, _size(m.size), m.quant or "?", "+".join(m.variants), _ago(m.modified))
    Console().print(table)
    return 0


# -- show -----------------------------------------------------------------------------------

def _engine_line(engine: dict[str, Any]) -> str:
    """'8192 tokens per request, 8 at once (a KV stream each, f16: exact answers)'."""
    line = f"{engine['context_per_request']} tokens per request, {engine['concurrent_requests']} at once"
    if engine["kv_layout"] == "streams":
        return line + f" (a KV stream each, {engine['kv_type']}" + (": exact answers)" if engine["exact"] else ")")
    return line + (f" ({engine['full_length_requests']} at full length: one {engine['kv_type']} pool of "
                   f"{engine['kv_cells']} cells)")


def _projector_row(mmproj: Any, kind: str) -> str:
    """`show`'s vision / audio line: yes with the projector that takes it, or why not."""
    if mmproj is None:
        return "no (no projector)"
    return f"yes: projector {mmproj}" if kind in kinds(mmproj) else f"no (its projector takes no {kind})"


def _kv_saved(mem: dict[str, Any], kv_type: str) -> str:
    """' (q8_0/f16: 3.2 MiB less than f16)' where the KV types are smaller than f16."""
    from ..runtime.memory import format_bytes

    saved = mem["kv_f16_bytes"] - mem["kv_bytes"]
    if saved == 0:
        return ""
    return f" ({kv_type}: {format_bytes(abs(saved))} {'less' if saved > 0 else 'more'} than f16)"


def _at_rest_line(mem: dict[str, Any]) -> str:
    """What a loaded, idle model holds (runtime/describe.py at_rest): `ps` shows it measured."""
    from ..runtime.memory import format_bytes

    if mem["kv_follows_use"]:
        return f"about {format_bytes(mem['at_rest_bytes'])} (weights + compute: KV is committed as requests use it)"
    return f"{format_bytes(mem['at_rest_bytes'])} (the KV cache is reserved at load here)"


def runs_on(place: dict[str, Any]) -> str:
    if place.get("backend") is None:
        return "nothing here"
    ep = f" via {place['execution_provider']}" if place.get("execution_provider") else ""
    return f"{place['backend']} on {place['device_name']} ({place['device']}){ep}"


def run_show(args: argparse.Namespace, settings: Settings) -> int:
    model = ModelStore(settings).find(args.model)
    info = describe_model(model, settings, args.ctx)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from ..runtime.memory import format_bytes

    mem = info["memory"]
    place = info["placement"]
    table = Table(box=None, show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # paths and digests wrap whole rather than being cut off
    variant_rows = [(f"variant {fmt}", f"{_size(v.size)}, sha256 {v.sha256}" + (f", {len(v.files)} files" if v.files else "")
                     + ("" if v.available else " (missing)")) for fmt, v in model.variants.items()]
    if mem is None:
        rows = [("model", model.ref), ("architecture", str(info["architecture"] or "unknown")), *variant_rows,
                ("runs on", runs_on(place)), ("why", str(place["reason"]))]
        for key, value in rows:
            table.add_row(key, value)
        Console().print(table)
        return 0
    rows = [
        ("model", model.ref),
        ("architecture", info["architecture"]),
        ("parameters", _count(info["parameters"])),
        ("context length", str(info["context_length"])),
        ("quantization", str(info["quantization"])),
        ("chat template", "yes" if info["chat_template"] else "no"),
        ("license", str(info["license"] or "unknown")),
        ("size", _size(model.size)),
        ("sha256", str(model.sha256)),
        ("file", str(model.path) + ("  (registered in place)" if model.in_place else "")),
        ("vision", _projector_row(model.mmproj, "vision")),
        ("audio", _projector_row(model.mmproj, "audio")),
        ("LoRA adapters", "; ".join(f"{i}: {p}" for i, p in enumerate(info["loras"])) or "none"),
        ("source", str(info["source"] or "")),
        ("engine", _engine_line(info["engine"])),
        (f"memory @ {mem['n_ctx']} ctx" if info["ctx_given"] else "memory as loaded",
         f"at most {format_bytes(mem['total_bytes'])} (weights {format_bytes(mem['weights_bytes'])} + "
         f"KV {format_bytes(mem['kv_bytes'])}{_kv_saved(mem, info['engine']['kv_type'])} + "
         f"compute {format_bytes(mem['compute_bytes'])})"),
        ("memory at rest", _at_rest_line(mem)),
        *variant_rows,
        ("runs on", runs_on(place)),
        ("why", str(place["reason"])),
    ]
    if info["native"]:
        rows.append(("llama.cpp here", info["native"]))
    gpu = info["gpu"]
    if gpu["layers"]:
        rows.append(("on the GPU", f"{gpu['layers']} of {gpu['of_layers']} layers, "
                                   f"{format_bytes(gpu['memory_bytes'])} (estimated)"))
    if len(place.get("vram_per_device") or ()) > 1:
        cards = place["device"].removeprefix("gpu:").split(",")
        rows.append(("per GPU", ", ".join(f"gpu:{i} {format_bytes(n)}" for i, n in zip(cards, place["vram_per_device"]))
                     + f" ({place['split_mode']} split, estimated)"))
    if gpu["experts_ram_bytes"]:
        whose = "every layer" if gpu["cpu_moe_layers"] < 0 else f"the first {gpu['cpu_moe_layers']} layers"
        rows.append(("in RAM", f"MoE experts of {whose}, {format_bytes(gpu['experts_ram_bytes'])} (cpu_moe)"))
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
    return 0


# -- rm / add -------------------------------------------------------------------------------

def run_rm(args: argparse.Namespace, settings: Settings) -> int:
    store = ModelStore(settings)
    for ref in args.models:
        model = store.remove(ref)
        note = " (unregistered; your file was left in place)" if model.in_place else ""
        print(f"deleted {model.ref}{note}")
    return 0


def run_cache(args: argparse.Namespace, settings: Settings) -> int:
    """`cache clear`: every model's cached prompts (store/prompt_cache.py) deleted; `cache info`: their size."""
    from ..store import prompt_cache

    files, used = prompt_cache.usage(settings.home)
    if args.action == "clear":
        prompt_cache.clear(settings.home)
        print(f"deleted {files} cached prompts ({used / 2**20:.1f} MiB)")
    else:
        print(f"{files} cached prompts, {used / 2**20:.1f} MiB of {settings.prompt_cache_disk_bytes / 2**20:.0f} MiB")
    return 0


def run_add(args: argparse.Namespace, settings: Settings) -> int:
    ref = parse_ref(args.name)
    if "/" in ref.name:  # hf.co/... and URLs included
        raise InvalidRequestError("--name must be a plain NAME[:TAG] (no slashes)")
    store = ModelStore(settings)
    if Path(args.path).expanduser().is_dir():
        if args.mmproj or args.lora:
            raise InvalidRequestError("--mmproj and --lora go with a .gguf model file, not a folder")
        from ..store.model_dirs import detect_kind

        kind = detect_kind(Path(args.path).expanduser())
        model = store.add_directory(args.path, ref.name, ref.tag or "latest")
        v = model.variants[kind]
        print(f"added {model.ref}: {kind} variant ({len(v.files)} files, {_size(v.size)}, sha256 {(v.sha256 or '?')[:12]}…)")
        return 0
    model = store.register_local(args.path, ref.name, ref.tag or "latest", mmproj=args.mmproj, loras=args.lora)
    print(f"added {model.ref} -> {model.path} ({_size(model.size)}, {model.quant or 'unknown quant'})")
    if model.mmproj is not None:
        print(f"  vision projector -> {model.mmproj}")
    for i, adapter in enumerate(model.loras):
        print(f"  LoRA adapter {i} -> {adapter}")
    return 0


# -- formatting -------------------------------------------------------------------------------

def _scaled(n: int | None, units: tuple[tuple[str, float], ...], plain: str) -> str:
    if not n:
        return "?"
    for unit, scale in units:
        if n >= scale:
            return f"{n / scale:.1f}{unit}" + (f" ({n:,})" if plain == "count" else "")
    return f"{n} B" if plain == "bytes" else str(n)


def _size(n: int | None) -> str:
    return _scaled(n, ((" GB", 1e9), (" MB", 1e6), (" KB", 1e3)), "bytes")


def _count(n: int | None) -> str:
    return _scaled(n, (("B", 1e9), ("M", 1e6), ("K", 1e3)), "count")


def _ago(epoch: float) -> str:
    delta = max(0.0, time.time() - epoch)
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if delta >= seconds:
            count = int(delta // seconds)
            return f"{count} {unit}{'s' if count != 1 else ''} ago"
    return "just now"
