"""Apple silicon from sysctl: a Metal GPU sharing unified memory, and the Neural Engine.

Metal may wire only part of unified memory for the GPU (`recommendedMaxWorkingSetSize`): by
default about 2/3 of RAM up to 36 GiB and 3/4 above (what llama.cpp logs on 16/32/64 GiB Macs),
unless the user raised it with `sysctl iogpu.wired_limit_mb`.
"""

from __future__ import annotations

from .env import ProbeEnv
from .ids import make_npu
from .report import GPUInfo, NPUInfo

GiB = 1 << 30
MiB = 1 << 20


def metal_budget(ram: int, wired_limit_mb: int = 0) -> int:
    if wired_limit_mb > 0:
        return wired_limit_mb * MiB
    return ram * 2 // 3 if ram <= 36 * GiB else ram * 3 // 4


def _apple_silicon(env: ProbeEnv) -> tuple[str, int] | None:
    assert env.sysctl is not None
    if env.sysctl("hw.optional.arm64") != "1":
        return None  # Intel Mac: no Metal offload worth doing in llama.cpp
    brand = env.sysctl("machdep.cpu.brand_string") or "Apple silicon"
    memsize = env.sysctl("hw.memsize") or ""
    return brand, int(memsize) if memsize.isdigit() else 0


def probe_gpus_darwin(env: ProbeEnv) -> list[GPUInfo]:
    chip = _apple_silicon(env)
    if chip is None:
        return []
    brand, ram = chip
    assert env.sysctl is not None
    wired = env.sysctl("iogpu.wired_limit_mb") or "0"
    budget = metal_budget(ram, int(wired) if wired.isdigit() else 0) if ram else None
    return [GPUInfo(
        vendor="Apple",
        name=f"{brand} GPU",
        kind="unified",
        vram_bytes=budget,
        vram_free_bytes=None,
        apis=["Metal"],
        source="sysctl",
    )]


def probe_npus_darwin(env: ProbeEnv) -> list[NPUInfo]:
    chip = _apple_silicon(env)
    if chip is None:
        return []
    npu = make_npu("Apple", f"Apple Neural Engine ({chip[0]})", None, None, "sysctl")
    npu.generation = "ANE"
    npu.llm_capable = False
    npu.note = "reachable only through Core ML; localserve runs LLMs on the Metal GPU"
    return [npu]
