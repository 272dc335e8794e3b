"""GPUs listed by the installed llama.cpp build (ggml's device registry, hardware/ggml.py): a
software Vulkan device no OS probe sees (lavapipe) becomes a GPU placement can offload to; a card an
OS probe already found is not counted twice. Devices replayed from a recorded lavapipe machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fixtures.hw.loader import fixture_env
from localserve.hardware import detect_hardware
from localserve.hardware.ggml import GgmlDevice, probe_ggml_devices
from localserve.store.gguf_facts import read_gguf_facts
from localserve.runtime.memory import estimate_memory
from localserve.runtime.placement import BackendChoice, choose_backend

# The Vulkan build on this machine with GGML_VK_VISIBLE_DEVICES=0 (Mesa 22.3 lavapipe: one 2 GiB
# device-local heap, no PCI function) beside ggml's CPU device.
CPU = GgmlDevice("CPU", "Intel(R) Xeon(R) Processor", "cpu", 25_276_510_208, 25_276_510_208)
LAVAPIPE = GgmlDevice("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", 2_147_483_648, 2_147_483_648)
VULKAN = (True, ["Vulkan"])


@pytest.fixture
def gpuless_root(tmp_path: Path) -> Path:
    """The recorded Intel laptop without its GPU in sysfs: what the lavapipe VM shows the OS probes."""
    root = tmp_path / "root"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures/hw/linux_intel/root", root)
    shutil.rmtree(root / "sys/class/drm")
    return root


def test_lavapipe_is_a_gpu_for_a_vulkan_build(gpuless_root: Path) -> None:
    report = detect_hardware(fixture_env("linux_intel", root=gpuless_root, llama=VULKAN,
                                         ggml_devices=lambda: [CPU, LAVAPIPE]))
    (gpu,) = [g for g in report.gpus if g.source == "ggml"]
    assert (gpu.name, gpu.apis, gpu.kind, gpu.vram_bytes) == ("llvmpipe (LLVM 15.0.6, 256 bits)", ["Vulkan"],
                                                              "discrete", 2_147_483_648)


def _placement(root: Path, devices: list[GgmlDevice], gguf: Path) -> BackendChoice:
    report = detect_hardware(fixture_env("linux_intel", root=root, llama=VULKAN, ggml_devices=lambda: devices))
    return choose_backend(report, ["gguf"], estimate=estimate_memory(read_gguf_facts(gguf), 2048))


def test_placement_offloads_to_lavapipe_fully_or_partly(gpuless_root: Path, smollm2_gguf: Path) -> None:
    """The real test model's sizes: all of it fits lavapipe's 2 GiB; with 660 MiB free (512 of them
    placement's reserve, ~97 compute) only some of its 3.6 MiB layers fit."""
    full = _placement(gpuless_root, [CPU, LAVAPIPE], smollm2_gguf)
    assert (full.backend, full.device, full.n_gpu_layers) == ("llamacpp", "gpu:0", -1)
    assert "llvmpipe" in full.device_name
    tight = GgmlDevice("Vulkan0", LAVAPIPE.description, "gpu", 660 << 20, LAVAPIPE.memory_total)
    part = _placement(gpuless_root, [CPU, tight], smollm2_gguf)
    assert part.device == "gpu:0" and 0 < part.n_gpu_layers < read_gguf_facts(smollm2_gguf).n_layers


def test_a_card_the_os_probes_found_is_not_listed_twice() -> None:
    os_only = detect_hardware(fixture_env("linux_nvidia", ggml_devices=lambda: [])).gpus
    bus = os_only[0].bus_id
    same = GgmlDevice("CUDA0", "NVIDIA GeForce RTX 4090", "gpu", 20 << 30, 24 << 30, bus)
    no_id = GgmlDevice("Vulkan0", "NVIDIA GeForce RTX 4090", "gpu", 20 << 30, 24 << 30)
    for devices in ([CPU, same], [CPU, no_id]):
        gpus = detect_hardware(fixture_env("linux_nvidia", ggml_devices=lambda d=devices: d)).gpus
        assert [(g.name, g.source) for g in gpus] == [(g.name, g.source) for g in os_only]


def test_this_build_lists_its_cpu_device() -> None:
    """The real registry through ctypes: whatever the build, ggml registered its CPU device."""
    devices = probe_ggml_devices()
    assert any(d.type == "cpu" and d.name == "CPU" and d.memory_total > 0 for d in devices)


def test_registered_backends_name_the_build() -> None:
    """probe_llama also reads ggml's registered backends (a Vulkan build's system info says only
    "CPU"; recorded there: ['Vulkan', 'CPU'] -> apis ['Vulkan']). This CPU build: no GPU API."""
    from localserve.hardware.ggml import backend_names
    from localserve.hardware.runtimes import parse_system_info, probe_llama

    names = backend_names()
    assert "CPU" in names
    assert parse_system_info(" | ".join(f"{n} :" for n in ["Vulkan", "CPU"])) == ["Vulkan"]
    assert probe_llama().gpu_apis == parse_system_info(" | ".join(f"{n} :" for n in names))
