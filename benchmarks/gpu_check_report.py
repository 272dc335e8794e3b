"""The device check's output: gpu_check.json (every figure) and gpu_check.txt (the table), written
into --out ($OUT on the device machine, so both come back with the reply) and the table printed
last, where the reply's output_tail shows it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ROWS = [
    ("decode_tps_1", "decode tok/s, 1 sequence", "{:.1f}"),
    ("decode_tps_8", "decode tok/s, 8 sequences", "{:.1f}"),
    ("A_tps", "load A output tok/s", "{:.1f}"),
    ("A_ttft_p50_ms", "load A TTFT p50 (ms)", "{:.1f}"),
    ("A_ttft_p95_ms", "load A TTFT p95 (ms)", "{:.1f}"),
    ("B_tps", "load B output tok/s", "{:.1f}"),
    ("B_ttft_p50_ms", "load B TTFT p50 (ms)", "{:.1f}"),
    ("B_ttft_p95_ms", "load B TTFT p95 (ms)", "{:.1f}"),
    ("decode_1_errors", "decode errors, 1 sequence", "{:.0f}"),
    ("decode_8_errors", "decode errors, 8 sequences", "{:.0f}"),
    ("A_errors", "load A errors", "{:.0f}"),
    ("B_errors", "load B errors", "{:.0f}"),
    ("gpu_memory_mib", "GPU memory held (MiB)", "{:.0f}"),
    ("gpu_layers", "layers on the GPU", "{:.0f}"),
    ("offloadable_layers", "layers offloadable", "{:.0f}"),
]


def bandwidth_bound(figures: dict[str, Any]) -> float | None:
    """Decode tok/s at batch 1 if every token read all weights once at the card's bandwidth.
    Every tensor counts: with tied embeddings (1b, 3b) the output matrix is token_embd, read whole;
    for 8b the input embedding (200 MB of 4.9 GB) is only looked up, so that bound is ~4% low."""
    bandwidth = figures.get("bandwidth_bytes_per_s")
    return bandwidth / figures["weight_bytes"] if bandwidth and figures.get("weight_bytes") else None


def table(figures: dict[str, Any]) -> str:
    servers = {n: f for n, f in figures.get("servers", {}).items() if n != "llama-batched-bench"}
    lines = [f"device: {figures.get('gpu', 'CPU (the twin)')}, model {figures.get('model', '-')} "
             f"({figures.get('shape', '-')}, {figures.get('weight_bytes', 0) / 2**20:.1f} MiB of weights), "
             f"threads {figures.get('threads')}"]
    if "build_s" in figures:
        lines.append(f"CUDA build for sm_{figures['cuda_arch']:.0f}: configure {figures['configure_s']:.0f} s, "
                     f"build {figures['build_s']:.0f} s; model made in {figures.get('model_s', math.nan):.0f} s")
        if figures.get("cmake_fallbacks"):
            lines.append(f"(the toolkit lacked parts; configured with {figures['cmake_fallbacks']})")
    width = max(len(label) for _, label, _ in ROWS) + 2
    lines.append("".ljust(width) + "".join(name.rjust(16) for name in servers))
    for key, label, fmt in ROWS:
        if any(key in f for f in servers.values()):
            lines.append(label.ljust(width) + "".join(
                (fmt.format(f[key]) if key in f else "-").rjust(16) for f in servers.values()))
    for name, f in servers.items():
        if "skipped" in f or "note" in f:
            lines.append(f"{name}: {f.get('skipped') or f.get('note')}")
    if ceiling := figures.get("servers", {}).get("llama-batched-bench"):
        lines.append("llama-batched-bench (128-token prompts, 128 out): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in ceiling.items()))
    if bound := bandwidth_bound(figures):
        reached = ", ".join(f"{name} reaches {100 * f['decode_tps_1'] / bound:.0f}%"
                            for name, f in servers.items() if "decode_tps_1" in f)
        lines.append(f"bandwidth bound at 1 sequence: {figures['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s / "
                     f"{figures['weight_bytes'] / 1e6:.0f} MB per token = {bound:.0f} tok/s; {reached}")
    else:
        lines.append("bandwidth bound: not computed (no card of known bandwidth)")
    lines += moe_lines(figures.get("moe") or {})
    if "failed" in figures:
        lines.append(f"FAILED: {figures['failed']} (see log.txt, build.log and the servers' logs)")
    lines.append(f"total {figures.get('total_s', math.nan):.0f} s")
    return "\n".join(lines)


def moe_lines(moe: dict[str, Any]) -> list[str]:
    """The MoE stage's rows: decode tok/s of each server with the first N layers' experts in RAM."""
    if not moe:
        return []
    if "skipped" in moe:
        return [f"MoE stage: skipped ({moe['skipped']})"]
    lines = [f"MoE {moe['shape']} ({moe['weight_bytes'] / 2**20:.1f} MiB), experts of the first {moe['n_cpu_moe']} "
             f"layers in RAM (n_cpu_moe / --n-cpu-moe):"]
    for name, f in moe["servers"].items():
        if "skipped" in f:
            lines.append(f"  {name}: skipped ({f['skipped']})")
            continue
        where = f", {f['moe_layers_in_ram']} layers' experts in RAM per /api/ps" if "moe_layers_in_ram" in f else ""
        lines.append(f"  {name}: decode tok/s {f['decode_tps_1']:.1f} at 1 sequence, {f['decode_tps_8']:.1f} at 8"
                     + (f", GPU memory {f['gpu_memory_mib']:.0f} MiB" if "gpu_memory_mib" in f else "") + where)
    return lines


def write_report(figures: dict[str, Any], out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=2, default=str))
    text = table(figures)
    (out / "gpu_check.txt").write_text(text + "\n")
    print("\n" + text, flush=True)
