"""`localserve hw`: what this machine has and what localserve can run on it (offline, no daemon)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from ..runtime.buildinfo import Toolkits, installed_build, installed_version, recommend, setup_command
from ..config.settings import Settings
from ..hardware import HardwareReport, detect_hardware
from ..runtime.memory import format_bytes
from ..runtime.describe import native_condition


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("hw", parents=[common], help="show CPU, RAM, GPUs, NPUs and runtimes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_hw)


def run_hw(args: argparse.Namespace, settings: Settings) -> int:
    report = detect_hardware()
    build = build_summary(report, Toolkits.probe())
    placements = model_placements(report, settings)
    build["native"] = native_condition(report)
    if args.json:
        print(json.dumps({**report.to_dict(), "llama_build": build, "models": placements}, indent=2))
    else:
        console = Console()
        console.print(render(report))
        console.print(render_build(build))
        if build["native"]:
            console.print(f"  {build['native']}")
        if placements:
            console.print(render_placements(placements))
    return 0


def model_placements(report: HardwareReport, settings: Settings) -> list[dict[str, Any]]:
    """Backend, device and EP each installed model gets here, and why: the registry's choice, as a
    load makes it, at the default context (`show MODEL --ctx N` sizes one model for another)."""
    from ..runtime.registry import choose
    from ..errors import LocalserveError
    from ..store.cache import ModelStore

    rows = []
    for model in ModelStore(settings).list():
        row: dict[str, Any] = {"model": model.ref, "variants": list(model.variants)}
        try:
            row.update(choose(model, settings, report, _estimate(model, settings)).as_dict())
        except LocalserveError as e:  # nothing here can run it, or a bad preference: say so in its row
            row.update(backend=None, reason=str(e))
        rows.append(row)
    return rows


def _estimate(model: Any, settings: Settings) -> Any:
    from ..store.gguf_facts import GGUFFacts
    from ..runtime.memory import estimate_memory

    if not model.facts:
        return None
    facts = GGUFFacts.from_dict(model.facts)
    return estimate_memory(facts, settings.context_length or min(facts.context_length or 8192, 8192))


def render_placements(rows: list[dict[str, Any]]) -> Table:
    from .models import runs_on

    table = Table(title="where installed models run", show_lines=False)
    for column in ("model", "variants", "runs on", "why"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["model"], "+".join(row["variants"]), runs_on(row), row["reason"])
    return table


def build_summary(report: HardwareReport, toolkits: Toolkits) -> dict[str, Any]:
    """The installed llama.cpp build, the best one for this machine and the command that gets it."""
    rec = recommend(report, toolkits)
    installed = installed_build(report)
    return {"installed": installed, "version": installed_version(), "recommended": rec.as_dict(),
            "command": None if installed == rec.build else setup_command(rec.build)}


def render_build(build: dict[str, Any]) -> str:
    rec = build["recommended"]
    lines = [f"llama.cpp build: {build['installed'] or 'not installed'}; best here: {rec['build']} ({rec['reason']})"]
    if build["command"]:
        lines.append(f"  get it with: {build['command']}")
    lines += [f"  [yellow]missing[/] {line}" for line in rec["missing"]]
    return "\n".join(lines)


def _size(n: int | None) -> str:
    return format_bytes(n) if n is not None else "?"


def render(report: HardwareReport) -> Table:
    """One row per device, then the runtimes; probe errors last, so a partial report says why."""
    table = Table(title="localserve hardware", show_lines=False)
    for column in ("device", "name", "memory", "details"):
        table.add_column(column)
    cpu = report.cpu
    cores = f"{cpu.cores_physical or '?'} cores / {cpu.cores_logical or '?'} threads"
    if cpu.cores_usable and cpu.cores_usable != cpu.cores_logical:
        cores += f" ({cpu.cores_usable} usable)"
    table.add_row("CPU", cpu.model, "", f"{cpu.arch}, {cores}; {' '.join(cpu.features) or 'no SIMD features found'}")
    table.add_row("RAM", "", f"{_size(report.ram_total_bytes)} total", f"{_size(report.ram_available_bytes)} available")
    for i, gpu in enumerate(report.gpus):
        memory = {"unified": "unified, GPU share"}.get(gpu.kind, gpu.kind)
        if gpu.vram_bytes is not None:
            memory = f"{_size(gpu.vram_bytes)} {memory}"
        if gpu.vram_free_bytes is not None:
            memory += f", {_size(gpu.vram_free_bytes)} free"
        details = ", ".join(filter(None, ["/".join(gpu.apis), gpu.arch and f"arch {gpu.arch}", gpu.driver and f"driver {gpu.driver}"]))
        table.add_row(f"GPU {i}", gpu.name, memory, details)
    if not report.gpus:
        table.add_row("GPU", "none found", "", "")
    for i, npu in enumerate(report.npus):
        details = ", ".join(filter(None, [npu.generation, npu.driver and f"driver {npu.driver}",
                                          "EP " + "/".join(npu.execution_providers) if npu.execution_providers else None,
                                          npu.note]))
        table.add_row(f"NPU {i}", npu.name, "", details)
    if report.llama_gpu_offload is None:
        llama = "not installed"
    elif report.llama_gpu_offload:
        llama = "GPU offload (" + ("/".join(report.llama_gpu_apis) or "backend unknown") + ")"
    else:
        llama = "CPU only (no GPU offload in this build)"
    table.add_row("llama.cpp", "llama-cpp-python", "", llama)
    onnx = "not installed" if report.onnx_providers is None else ", ".join(report.onnx_providers) or "no providers"
    table.add_row("ONNX Runtime", "onnxruntime", "", onnx)
    for error in report.errors:
        table.add_row("[yellow]probe error[/]", "", "", error)
    return table
