"""Linux GPUs and NPUs from sysfs: /sys/class/drm, /sys/class/kfd (ROCm), /sys/class/accel."""

from __future__ import annotations

import os
from pathlib import Path

from .env import ProbeEnv
from .ids import VENDORS, gpu_display_name, is_intel_discrete, make_npu, pci_name
from .report import GPUInfo, GPUKind, NPUInfo

NPU_DRIVERS = {"amdxdna": "AMD", "intel_vpu": "Intel", "qaic": "Qualcomm"}


def _read(env: ProbeEnv, directory: Path, name: str) -> str | None:
    """`directory/name` of the probe world (`directory` is a path under `env.root`)."""
    return env.read_text(str(directory.relative_to(env.root)), name)


def _uevent(env: ProbeEnv, device: Path) -> dict[str, str]:
    """The device's uevent (DRIVER, PCI_ID, PCI_CLASS, PCI_SLOT_NAME): plain files, no symlinks to
    follow, which is why we prefer it to device/driver and device/vendor."""
    text = _read(env, device, "uevent") or ""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip()
    if "DRIVER" not in out and os.path.islink(device / "driver"):
        out["DRIVER"] = os.path.basename(os.readlink(device / "driver"))
    return out


def _ids(env: ProbeEnv, device: Path, ue: dict[str, str]) -> tuple[str, str] | None:
    if "PCI_ID" in ue:
        vendor, _, dev = ue["PCI_ID"].lower().partition(":")
        return vendor, dev
    vendor_file, device_file = _read(env, device, "vendor"), _read(env, device, "device")
    if vendor_file and device_file:
        return vendor_file.strip().lower().removeprefix("0x"), device_file.strip().lower().removeprefix("0x")
    return None


def _int_file(env: ProbeEnv, device: Path, name: str) -> int | None:
    text = _read(env, device, name)
    try:
        return int(text.strip()) if text else None
    except ValueError:
        return None


def _gfx_name(version: int) -> str:
    # KFD encodes gfx targets as major*10000 + minor*100 + stepping; stepping is printed in hex (gfx90a).
    return f"gfx{version // 10000}{version // 100 % 100}{version % 100:x}"


def _rocm_targets(env: ProbeEnv) -> dict[str, str]:
    """PCI slot -> gfx target for every GPU the ROCm kernel driver (KFD) exposes."""
    nodes = env.path("sys/class/kfd/kfd/topology/nodes")
    targets: dict[str, str] = {}
    if not nodes.is_dir():
        return targets
    for node in sorted(nodes.iterdir()):
        props = {}
        for line in (_read(env, node, "properties") or "").splitlines():
            key, _, value = line.partition(" ")
            props[key] = value.strip()
        version = int(props.get("gfx_target_version", "0") or 0)
        minor = props.get("drm_render_minor")
        if not version or not minor:
            continue  # CPU node
        slot = _uevent(env, env.path(f"sys/class/drm/renderD{minor}/device")).get("PCI_SLOT_NAME")
        if slot:
            targets[slot] = _gfx_name(version)
    return targets


def probe_gpus_linux(env: ProbeEnv) -> list[GPUInfo]:
    drm = env.path("sys/class/drm")
    if not drm.is_dir():
        return []
    rocm = _rocm_targets(env)
    gpus = []
    for card in sorted(drm.glob("card[0-9]*"), key=lambda p: int("".join(c for c in p.name[4:] if c.isdigit()) or 0)):
        if "-" in card.name:  # connectors: card0-DP-1
            continue
        device = card / "device"
        ue = _uevent(env, device)
        ids = _ids(env, device, ue)
        pci_class = ue.get("PCI_CLASS") or (_read(env, device, "class") or "").strip()
        if ids is None or not pci_class:
            continue  # simpledrm / efifb framebuffers: not a GPU we can compute on
        try:
            if int(pci_class, 16) >> 16 != 0x03:
                continue  # not a display controller
        except ValueError:
            continue
        vendor_id, device_id = ids
        vendor = VENDORS.get(vendor_id, vendor_id)
        driver = ue.get("DRIVER")
        slot = ue.get("PCI_SLOT_NAME")
        vram = _int_file(env, device, "mem_info_vram_total")
        used = _int_file(env, device, "mem_info_vram_used")
        apis = ["Vulkan"]
        arch = None
        kind: GPUKind
        if vendor == "AMD":
            # amdgpu exposes board_info only on dGPUs; APUs have a small carve-out as "VRAM".
            kind = "discrete" if (device / "board_info").exists() else "integrated"
            if slot in rocm:
                apis, arch = ["ROCm", "Vulkan"], rocm[slot]
        elif vendor == "Intel":
            kind = "discrete" if is_intel_discrete(device_id) else "integrated"
            apis = ["SYCL", "Vulkan"]
        elif vendor == "NVIDIA":
            kind = "discrete"
            apis = ["CUDA", "Vulkan"] if driver == "nvidia" else ["Vulkan"]
        else:
            kind = "integrated"
        gpus.append(GPUInfo(
            vendor=vendor,
            name=gpu_display_name(env, vendor_id, device_id),
            kind=kind,
            vram_bytes=vram,
            vram_free_bytes=vram - used if vram is not None and used is not None else None,
            apis=apis,
            arch=arch,
            driver=driver,
            pci_id=f"{vendor_id}:{device_id}",
            bus_id=slot,
            source="sysfs",
        ))
    return gpus


def probe_npus_linux(env: ProbeEnv) -> list[NPUInfo]:
    accel = env.path("sys/class/accel")
    if not accel.is_dir():
        return []
    npus = []
    for node in sorted(accel.glob("accel[0-9]*")):
        device = node / "device"
        ue = _uevent(env, device)
        driver = ue.get("DRIVER")
        if driver not in NPU_DRIVERS:
            continue  # other accelerators (e.g. habanalabs) are not NPUs we can drive
        vendor = NPU_DRIVERS[driver]
        ids = _ids(env, device, ue)
        name = (pci_name(env, *ids) if ids else None) or "NPU"
        npus.append(make_npu(vendor, name, driver, ids, "sysfs"))
    return npus
