"""Run the probes for this OS, each on its own thread with a deadline, and assemble the report.

A probe that raises or overruns becomes one line in `errors`; the rest of the report stands. A
hung probe (an NFS-mounted sysfs, a wedged nvidia-smi) is abandoned on a daemon thread rather than
joined, so `localserve hw` and daemon start-up never wait on it past the deadline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import apple, cpu, linux, nvidia, windows
from .ggml import gpus_from_ggml
from .env import ProbeEnv, ProbeError
from .report import CPUInfo, GPUInfo, HardwareReport, NPUInfo
from .runtimes import LlamaBuild

Probe = Callable[[ProbeEnv], Any]

PROBES: dict[str, dict[str, Probe]] = {
    "Linux": {
        "cpu": cpu.probe_cpu_linux, "memory": cpu.probe_memory, "gpu:sysfs": linux.probe_gpus_linux,
        "gpu:nvidia-smi": nvidia.probe_nvidia_smi, "npu:sysfs": linux.probe_npus_linux,
    },
    "Windows": {
        "cpu": cpu.probe_cpu_windows, "memory": cpu.probe_memory, "gpu:registry": windows.probe_gpus_windows,
        "gpu:nvidia-smi": nvidia.probe_nvidia_smi, "npu:registry": windows.probe_npus_windows,
    },
    "Darwin": {
        "cpu": cpu.probe_cpu_darwin, "memory": cpu.probe_memory, "gpu:sysctl": apple.probe_gpus_darwin,
        "npu:sysctl": apple.probe_npus_darwin,
    },
}
RUNTIME_PROBES: dict[str, Probe] = {
    "llama.cpp": lambda env: env.llama_build(),
    "onnxruntime": lambda env: env.onnx_providers(),
    "gpu:ggml": lambda env: gpus_from_ggml(env.ggml_devices()),
}


@dataclass
class _Outcome:
    value: Any = None
    error: str | None = None
    done: bool = False


def _run_all(probes: dict[str, Probe], env: ProbeEnv, deadline_s: float) -> dict[str, _Outcome]:
    outcomes = {name: _Outcome() for name in probes}

    def work(name: str, probe: Probe) -> None:
        out = outcomes[name]
        try:
            out.value = probe(env)
        except Exception as e:  # noqa: BLE001 - any probe failure is reported, never raised
            # Expected failures carry their own message; anything else is a bug worth naming.
            out.error = str(e) if isinstance(e, (ProbeError, RuntimeError, OSError)) else f"{type(e).__name__}: {e}"
        out.done = True

    threads = [threading.Thread(target=work, args=item, daemon=True, name=f"probe-{item[0]}") for item in probes.items()]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    for out in outcomes.values():
        if not out.done:
            out.error = f"timed out after {deadline_s:g}s"
    return outcomes


def _merge_gpus(found: list[GPUInfo]) -> list[GPUInfo]:
    """nvidia-smi knows NVIDIA cards best (free VRAM, compute capability): its entries replace the
    sysfs/registry view of the same cards, matched by PCI bus id where both give one. Discrete and
    unified-memory GPUs come first, biggest first, so "gpu:0" is the one worth offloading to.
    ggml's devices (ggml.py) count only where no OS probe saw the card: another PCI bus id, or
    none given while the OS probes found no GPU at all (a software device like lavapipe)."""
    os_probed = [g for g in found if g.source != "ggml"]
    os_bus = {g.bus_id for g in os_probed if g.bus_id}
    found = os_probed + [g for g in found if g.source == "ggml" and (
        g.bus_id not in os_bus if g.bus_id else not os_probed)]
    smi = [g for g in found if g.source == "nvidia-smi"]
    if not smi:
        return sorted(found, key=_gpu_rank)
    smi_bus = {g.bus_id for g in smi}
    merged = []
    for g in found:
        if g.source != "nvidia-smi" and g.vendor == "NVIDIA" and (g.bus_id is None or g.bus_id in smi_bus):
            continue
        merged.append(g)
    # Keep sysfs's PCI id on the nvidia-smi entry.
    by_bus = {g.bus_id: g for g in found if g.source != "nvidia-smi" and g.bus_id}
    for g in smi:
        if g.bus_id in by_bus and g.pci_id is None:
            g.pci_id = by_bus[g.bus_id].pci_id
    return sorted(merged, key=_gpu_rank)


def _gpu_rank(gpu: GPUInfo) -> tuple[bool, int]:
    return gpu.kind == "integrated", -(gpu.vram_bytes or 0)


def detect_hardware(env: ProbeEnv | None = None, *, deadline_s: float | None = None) -> HardwareReport:
    """Probe this machine (or the fixture world `env` describes). Never raises."""
    env = env or ProbeEnv()
    probes = dict(PROBES.get(env.system, {"memory": cpu.probe_memory}))
    probes.update(RUNTIME_PROBES)
    outcomes = _run_all(probes, env, deadline_s if deadline_s is not None else env.timeout * 2)
    errors = [f"{name}: {out.error}" for name, out in outcomes.items() if out.error]

    def value(name: str, default: Any) -> Any:
        out = outcomes.get(name)
        return out.value if out is not None and out.error is None and out.value is not None else default

    cpu_info: CPUInfo = value("cpu", CPUInfo(model=f"{env.arch} CPU", arch=env.arch, cores_physical=None,
                                             cores_logical=None, cores_usable=None))
    ram_total, ram_available = value("memory", (None, None))
    gpus: list[GPUInfo] = []
    npus: list[NPUInfo] = []
    for name in probes:
        if name.startswith("gpu:"):
            gpus += value(name, [])
        elif name.startswith("npu:"):
            npus += value(name, [])
    llama: LlamaBuild = value("llama.cpp", LlamaBuild(None))
    return HardwareReport(
        os=env.system,
        cpu=cpu_info,
        ram_total_bytes=ram_total,
        ram_available_bytes=ram_available,
        gpus=_merge_gpus(gpus),
        npus=npus,
        onnx_providers=value("onnxruntime", None),
        llama_gpu_offload=llama.gpu_offload,
        llama_gpu_apis=llama.gpu_apis,
        errors=errors,
    )
