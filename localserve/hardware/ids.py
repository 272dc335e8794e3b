"""PCI vendor/device facts shared by the Linux and Windows probes."""

from __future__ import annotations

from .env import ProbeEnv
from .report import NPUInfo

VENDORS = {
    "10de": "NVIDIA", "1002": "AMD", "1022": "AMD", "8086": "Intel", "106b": "Apple",
    "qcom": "Qualcomm", "5143": "Qualcomm", "17cb": "Qualcomm", "1414": "Microsoft", "1af4": "Virtio",
}

# NPUs by PCI device id: (generation, can the vendor's LLM stack run on it).
# AMD: Ryzen AI's LLM flow (OGA hybrid / NPU-only) supports XDNA 2 only, not Phoenix/Hawk Point.
# Intel: kernel drivers/accel/ivpu/ivpu_drv.h.
NPU_IDS = {
    ("1022", "1502"): ("XDNA (Phoenix/Hawk Point)", False),
    ("1022", "17f0"): ("XDNA 2 (Strix/Krackan)", True),
    ("8086", "7d1d"): ("Meteor Lake", True),
    ("8086", "ad1d"): ("Arrow Lake", True),
    ("8086", "643e"): ("Lunar Lake", True),
    ("8086", "b03e"): ("Panther Lake", True),
    ("8086", "fd3e"): ("Wildcat Lake", True),
    ("8086", "d71d"): ("Nova Lake", True),
}

# ONNX Runtime execution providers that drive each vendor's NPU, best first.
NPU_PROVIDERS = {
    "AMD": ["VitisAIExecutionProvider"],
    "Intel": ["OpenVINOExecutionProvider"],
    "Qualcomm": ["QNNExecutionProvider"],
    "Apple": ["CoreMLExecutionProvider"],
}


def is_intel_discrete(device_id: str) -> bool:
    """Intel Arc dGPUs: DG2/Alchemist 0x56xx, Battlemage 0xe20x/0xe21x; every other Intel GPU is an iGPU."""
    d = device_id.lower()
    return d.startswith("56") or d.startswith("e20") or d.startswith("e21")


def pci_name(env: ProbeEnv, vendor: str, device: str) -> str | None:
    """Device name from the pci.ids database under the probe root, if the system has one."""
    for rel in ("usr/share/hwdata/pci.ids", "usr/share/misc/pci.ids", "usr/share/pci.ids"):
        path = env.path(rel)
        try:
            f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed below
        except OSError:
            continue
        with f:
            in_vendor = False
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                if not line.startswith("\t"):
                    if in_vendor:
                        return None
                    in_vendor = line[:4].lower() == vendor
                elif in_vendor and not line.startswith("\t\t") and line[1:5].lower() == device:
                    return line[5:].strip()
        return None
    return None


def gpu_display_name(env: ProbeEnv, vendor_id: str, device_id: str) -> str:
    vendor = VENDORS.get(vendor_id, vendor_id)
    name = pci_name(env, vendor_id, device_id)
    return f"{vendor} {name}" if name else f"{vendor} GPU [{vendor_id}:{device_id}]"


def make_npu(vendor: str, name: str, driver: str | None, ids: tuple[str, str] | None, source: str) -> NPUInfo:
    """An NPUInfo with the generation, LLM support and execution providers its ids imply."""
    generation, llm_capable = NPU_IDS.get(ids, (None, True)) if ids else (None, True)
    if vendor == "Qualcomm":
        generation = generation or "Hexagon"
    return NPUInfo(
        vendor=vendor,
        name=name if name.startswith(vendor) or vendor in name else f"{vendor} {name}",
        driver=driver,
        execution_providers=list(NPU_PROVIDERS.get(vendor, [])),
        generation=generation,
        pci_id=":".join(ids) if ids else None,
        llm_capable=llm_capable,
        note=None if llm_capable else "the vendor's LLM runtime does not support this NPU generation",
        source=source,
    )
