"""NVIDIA GPUs from `nvidia-smi` CSV (Linux and Windows): the one source with free VRAM and the
compute capability, which sysfs and the registry do not give."""

from __future__ import annotations

import csv
import io

from .env import ProbeEnv, ProbeError
from .report import GPUInfo

QUERY = "index,name,memory.total,memory.free,driver_version,pci.bus_id,compute_cap"
MiB = 1 << 20


def _number(text: str) -> int | None:
    try:
        return int(float(text)) * MiB
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _bus_id(text: str) -> str:
    # nvidia-smi prints an 8-digit PCI domain ("00000000:01:00.0"); sysfs uses 4 ("0000:01:00.0").
    domain, _, rest = text.strip().lower().partition(":")
    return f"{domain[-4:]}:{rest}" if rest else text.strip().lower()


def probe_nvidia_smi(env: ProbeEnv) -> list[GPUInfo]:
    argv = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
    try:
        out = env.run(argv, env.timeout)
    except ProbeError as e:
        if "compute_cap" not in str(e):
            raise
        # Drivers older than ~510 reject the compute_cap field: ask again without it.
        out = env.run([argv[0], f"--query-gpu={QUERY.rsplit(',', 1)[0]}", argv[2]], env.timeout)
    if out is None:
        return []  # not installed: no NVIDIA driver, nothing to report
    gpus = []
    for row in csv.reader(io.StringIO(out)):
        cells = [c.strip() for c in row]
        if len(cells) < 6:
            if cells:
                raise ProbeError(f"nvidia-smi: unexpected output line {','.join(cells)[:80]!r}")
            continue
        cap = cells[6] if len(cells) > 6 and cells[6][:1].isdigit() else None
        gpus.append(GPUInfo(
            vendor="NVIDIA",
            name=cells[1],
            kind="discrete",
            vram_bytes=_number(cells[2]),
            vram_free_bytes=_number(cells[3]),
            apis=["CUDA", "Vulkan"] if env.system != "Windows" else ["CUDA", "DirectML", "Vulkan"],
            arch=cap,
            driver=cells[4],
            bus_id=_bus_id(cells[5]),
            source="nvidia-smi",
        ))
    return gpus
