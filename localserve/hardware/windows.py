"""Windows GPUs and NPUs from the registry's device class keys (winreg: milliseconds, where
PowerShell's Get-PnpDevice takes seconds to start and WMI caps AdapterRAM at 4 GiB).

  Display adapters:     HKLM\\SYSTEM\\CurrentControlSet\\Control\\Class\\{4d36e968-e325-11ce-bfc1-08002be10318}\\NNNN
  Neural processors:    ...\\Class\\{f01a9d53-3ff6-48d2-9f97-c8a7004be10c}\\NNNN   (ComputeAccelerator, MCDM)

Each NNNN key has DriverDesc, ProviderName, DriverVersion, MatchingDeviceId ("pci\\ven_10de&dev_2684",
"ACPI\\VEN_QCOM&DEV_0C36") and, for GPUs, HardwareInformation.qwMemorySize. The class key also
holds a "Properties" subkey that an ordinary user may not open: it is skipped, not an error.
"""

from __future__ import annotations

import re

from .env import ProbeEnv
from .ids import VENDORS, is_intel_discrete, make_npu
from .report import GPUInfo, GPUKind, NPUInfo

CLASS_ROOT = r"SYSTEM\CurrentControlSet\Control\Class"
DISPLAY_CLASS = "{4d36e968-e325-11ce-bfc1-08002be10318}"
COMPUTE_ACCELERATOR_CLASS = "{f01a9d53-3ff6-48d2-9f97-c8a7004be10c}"
_ID_RE = re.compile(r"^(?:pci|acpi)\\ven_([0-9a-z]{4})&dev_([0-9a-z]{4})", re.IGNORECASE)
GiB = 1 << 30


def _class_devices(env: ProbeEnv, class_guid: str) -> list[dict[str, object]]:
    if env.registry is None:
        raise RuntimeError("no registry access")
    path = f"{CLASS_ROOT}\\{class_guid}"
    try:
        keys = env.registry.subkeys(path)
    except OSError:  # class never installed on this machine (no NPU driver ever)
        return []
    devices = []
    for key in keys:
        if not key.isdigit():  # "Properties" and "Configuration": not devices, often access-denied
            continue
        try:
            devices.append(env.registry.values(f"{path}\\{key}"))
        except OSError:
            continue
    return devices


def _ids(values: dict[str, object]) -> tuple[str, str] | None:
    m = _ID_RE.match(str(values.get("MatchingDeviceId") or ""))
    return (m.group(1).lower(), m.group(2).lower()) if m else None


def _memory(values: dict[str, object]) -> int | None:
    mem = values.get("HardwareInformation.qwMemorySize")
    if isinstance(mem, int):
        return mem
    legacy = values.get("HardwareInformation.MemorySize")  # DWORD or 4-byte binary, capped at 4 GiB
    if isinstance(legacy, (bytes, bytearray)) and len(legacy) >= 4:
        return int.from_bytes(bytes(legacy[:4]), "little")
    return legacy if isinstance(legacy, int) else None


def _driver_version(values: dict[str, object]) -> str | None:
    return str(values["DriverVersion"]) if values.get("DriverVersion") else None


def probe_gpus_windows(env: ProbeEnv) -> list[GPUInfo]:
    gpus = []
    for values in _class_devices(env, DISPLAY_CLASS):
        ids = _ids(values)
        if ids is None:
            continue  # Microsoft Basic Render Driver, remote/virtual displays: root\ or swd\ ids
        vendor_id, device_id = ids
        vendor = VENDORS.get(vendor_id, vendor_id.upper())
        if vendor in ("Microsoft", "Virtio"):
            continue
        vram = _memory(values)
        kind: GPUKind
        if vendor == "NVIDIA":
            kind = "discrete"
        elif vendor == "Intel":
            kind = "discrete" if is_intel_discrete(device_id) else "integrated"
        elif vendor == "AMD":
            # Windows shows an APU's BIOS carve-out as dedicated memory; dGPUs have at least 4 GiB. A
            # big-carve-out APU (Strix Halo) lands in "discrete", which is what placement needs anyway.
            kind = "discrete" if vram is not None and vram >= 4 * GiB else "integrated"
        else:
            kind = "integrated"
        apis = ["CUDA", "DirectML", "Vulkan"] if vendor == "NVIDIA" else ["DirectML", "Vulkan"]
        gpus.append(GPUInfo(
            vendor=vendor,
            name=str(values.get("DriverDesc") or f"{vendor} GPU"),
            kind=kind,
            vram_bytes=vram if kind == "discrete" else None,  # an iGPU's few MiB of "dedicated" memory mislead
            vram_free_bytes=None,
            apis=apis,
            driver=_driver_version(values),
            pci_id=f"{vendor_id}:{device_id}",
            source="registry",
        ))
    return gpus


def probe_npus_windows(env: ProbeEnv) -> list[NPUInfo]:
    npus = []
    for values in _class_devices(env, COMPUTE_ACCELERATOR_CLASS):
        ids = _ids(values)
        name = str(values.get("DriverDesc") or "NPU")
        vendor = VENDORS.get(ids[0], "") if ids else ""
        if not vendor:  # fall back on the provider ("Qualcomm Technologies, Inc.")
            provider = str(values.get("ProviderName") or "")
            vendor = next((v for v in ("Qualcomm", "Intel", "AMD") if v.lower() in provider.lower()), provider or "unknown")
        npus.append(make_npu(vendor, name, _driver_version(values), ids, "registry"))
    return npus
