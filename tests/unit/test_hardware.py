"""Hardware report: the real probes over recorded machines (tests/fixtures/hw), failure isolation,
and the real machine this runs on."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from rich.console import Console

from fixtures.hw.loader import CASES, RecordedCommands, fixture_env
from localserve.cli import main as cli_main
from localserve.commands.hw import render
from localserve.hardware import ProbeEnv, ProbeError, detect_hardware
from localserve.hardware.runtimes import parse_system_info

GiB = 1 << 30
MiB = 1 << 20


def gpu_rows(report):
    return [(g.vendor, g.name, g.kind, g.vram_bytes, g.apis, g.arch) for g in report.gpus]


def npu_rows(report):
    return [(n.vendor, n.name, n.driver, n.execution_providers, n.llm_capable) for n in report.npus]


# Expected reports, one per recorded machine: (cpu model, physical, logical, features, RAM total,
# GPUs, NPUs).
EXPECTED = {
    "linux_nvidia": (
        "AMD Ryzen 9 7950X 16-Core Processor", 16, 32,
        ["SSE4.2", "AVX", "AVX2", "FMA", "F16C", "AVX-512", "AVX512-VNNI", "AVX512-BF16"], (65_536_000 - 1_412_345) * 1024,
        [("NVIDIA", "NVIDIA GeForce RTX 4090", "discrete", 24564 * MiB, ["CUDA", "Vulkan"], "8.9"),
         ("AMD", "AMD GPU [1002:164e]", "integrated", 512 * MiB, ["ROCm", "Vulkan"], "gfx1036")],
        [],
    ),
    # linux_nvidia with a second RTX 4090 in nvidia-smi's answer: each card listed with its own free memory.
    "linux_2x4090": (
        "AMD Ryzen 9 7950X 16-Core Processor", 16, 32,
        ["SSE4.2", "AVX", "AVX2", "FMA", "F16C", "AVX-512", "AVX512-VNNI", "AVX512-BF16"], (65_536_000 - 1_412_345) * 1024,
        [("NVIDIA", "NVIDIA GeForce RTX 4090", "discrete", 24564 * MiB, ["CUDA", "Vulkan"], "8.9"),
         ("NVIDIA", "NVIDIA GeForce RTX 4090", "discrete", 24564 * MiB, ["CUDA", "Vulkan"], "8.9"),
         ("AMD", "AMD GPU [1002:164e]", "integrated", 512 * MiB, ["ROCm", "Vulkan"], "gfx1036")],
        [],
    ),
    # Recorded on a real cloud VM (tests/fixtures/hw/record_linux.sh): no nvidia-drm, so no
    # /sys/class/drm at all; the GPU is known from nvidia-smi alone. AMX is in the flags.
    "linux_h200": (
        "Intel(R) Xeon(R) Processor", 16, 16,
        ["SSE4.2", "AVX", "AVX2", "FMA", "F16C", "AVX-VNNI", "AVX-512", "AVX512-VNNI", "AVX512-BF16", "AMX"],
        131_981_020 * 1024,
        [("NVIDIA", "NVIDIA H200", "discrete", 143771 * MiB, ["CUDA", "Vulkan"], "9.0")],
        [],
    ),
    "linux_amd": (
        "AMD Ryzen 7 8700G w/ Radeon 780M Graphics", 8, 16,
        ["SSE4.2", "AVX", "AVX2", "FMA", "F16C", "AVX-512", "AVX512-VNNI", "AVX512-BF16"], 32_012_345 * 1024,
        [("AMD", "AMD Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]", "discrete", 25_753_026_560, ["ROCm", "Vulkan"], "gfx1100"),
         ("AMD", "AMD Phoenix1", "integrated", 512 * MiB, ["ROCm", "Vulkan"], "gfx1103")],
        [("AMD", "AMD Phoenix Neural Processing Unit", "amdxdna", ["VitisAIExecutionProvider"], False)],
    ),
    "linux_strix_halo": (
        "AMD RYZEN AI MAX+ 395 w/ Radeon 8060S", 16, 32,
        ["SSE4.2", "AVX", "AVX2", "FMA", "F16C", "AVX-VNNI", "AVX-512", "AVX512-VNNI", "AVX512-BF16"], 65_432_100 * 1024,
        [("AMD", "AMD GPU [1002:1586]", "integrated", 64 * GiB, ["ROCm", "Vulkan"], "gfx1151")],
        [("AMD", "AMD NPU", "amdxdna", ["VitisAIExecutionProvider"], True)],
    ),
    "linux_intel": (
        "Intel(R) Core(TM) Ultra 7 155H", 16, 22, ["SSE4.2", "AVX", "AVX2", "FMA", "F16C", "AVX-VNNI"], 31_574_112 * 1024,
        [("Intel", "Intel Meteor Lake-P [Intel Arc Graphics]", "integrated", None, ["SYCL", "Vulkan"], None)],
        [("Intel", "Intel Meteor Lake NPU", "intel_vpu", ["OpenVINOExecutionProvider"], True)],
    ),
    "apple_m2_pro": (
        "Apple M2 Pro", 12, 12, ["NEON", "FP16", "DOTPROD", "I8MM", "BF16"], 32 * GiB,
        [("Apple", "Apple M2 Pro GPU", "unified", 32 * GiB * 2 // 3, ["Metal"], None)],
        [("Apple", "Apple Neural Engine (Apple M2 Pro)", None, ["CoreMLExecutionProvider"], False)],
    ),
    "windows_snapdragon": (
        "Snapdragon(R) X Elite - X1E80100 - Qualcomm(R) Oryon(TM) CPU", 12, 12, ["NEON", "DOTPROD"], 34_011_049_984,
        [("Qualcomm", "Qualcomm(R) Adreno(TM) X1-85 GPU", "integrated", None, ["DirectML", "Vulkan"], None)],
        [("Qualcomm", "Snapdragon(R) X Elite - X1E80100 - Qualcomm(R) Hexagon(TM) NPU", "30.0.140.0",
          ["QNNExecutionProvider"], True)],
    ),
    "windows_nvidia": (
        "13th Gen Intel(R) Core(TM) i7-13700K", 16, 24, ["SSE4.2", "AVX", "AVX2"], 34_205_167_616,
        # The registry's RTX 3060 entry is replaced by nvidia-smi's; the Parsec virtual display is dropped.
        [("NVIDIA", "NVIDIA GeForce RTX 3060", "discrete", 12 * GiB, ["CUDA", "DirectML", "Vulkan"], "8.6"),
         ("Intel", "Intel(R) UHD Graphics 770", "integrated", None, ["DirectML", "Vulkan"], None)],
        [],
    ),
}


def test_every_fixture_has_expectations() -> None:
    assert sorted(EXPECTED) == CASES


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_recorded_machine(case: str) -> None:
    model, physical, logical, features, ram, gpus, npus = EXPECTED[case]
    report = detect_hardware(fixture_env(case))
    assert report.errors == []
    assert (report.cpu.model, report.cpu.cores_physical, report.cpu.cores_logical) == (model, physical, logical)
    assert report.cpu.features == features
    assert report.ram_total_bytes == ram
    assert gpu_rows(report) == gpus
    assert npu_rows(report) == npus
    json.dumps(report.to_dict())  # JSON-ready for `hw --json`


def test_nvidia_smi_details_and_merge() -> None:
    env = fixture_env("linux_nvidia")
    report = detect_hardware(env)
    rtx = report.gpus[0]
    assert (rtx.vram_free_bytes, rtx.driver, rtx.bus_id, rtx.pci_id, rtx.source) == (
        23662 * MiB, "550.54.14", "0000:01:00.0", "10de:2684", "nvidia-smi")
    assert ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free,driver_version,pci.bus_id,compute_cap",
            "--format=csv,noheader,nounits"] in env.run.calls


def test_amd_free_vram_from_sysfs() -> None:
    xtx = detect_hardware(fixture_env("linux_amd")).gpus[0]
    assert xtx.vram_free_bytes == 25_753_026_560 - 1_073_741_824
    assert (xtx.bus_id, xtx.driver) == ("0000:03:00.0", "amdgpu")


def test_old_nvidia_driver_without_compute_cap() -> None:
    class OldDriver(RecordedCommands):
        def __call__(self, argv, timeout):
            self.calls.append(list(argv))
            if "compute_cap" in argv[1]:
                raise ProbeError('nvidia-smi failed (exit 2): Field "compute_cap" is not a valid field to query.')
            return "0, Tesla P40, 24576, 24400, 470.256.02, 00000000:3B:00.0\n"

    report = detect_hardware(fixture_env("linux_nvidia", run=OldDriver({})))
    p40 = report.gpus[0]
    assert (p40.name, p40.vram_bytes, p40.arch, p40.bus_id) == ("Tesla P40", 24576 * MiB, None, "0000:3b:00.0")
    assert report.errors == []


def test_nvidia_smi_unsupported_fields() -> None:
    out = "0, NVIDIA GeForce GTX 1050, [N/A], [N/A], 535.183.01, 00000000:01:00.0, 6.1\n"
    gpu = detect_hardware(fixture_env("linux_nvidia", run=RecordedCommands({"nvidia-smi": out}))).gpus[0]
    assert (gpu.name, gpu.vram_bytes, gpu.vram_free_bytes, gpu.arch) == ("NVIDIA GeForce GTX 1050", None, None, "6.1")


def test_a_failing_probe_is_an_error_line_not_a_failure() -> None:
    broken = RecordedCommands({"nvidia-smi": {"error": "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because "
                                                       "it couldn't communicate with the NVIDIA driver."}})
    report = detect_hardware(fixture_env("linux_nvidia", run=broken))
    assert report.errors == ["gpu:nvidia-smi: nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't "
                             "communicate with the NVIDIA driver."]
    # sysfs still sees both cards; the NVIDIA one without nvidia-smi's details, still listed first.
    assert [(g.vendor, g.kind, g.vram_bytes, g.source) for g in report.gpus] == [
        ("NVIDIA", "discrete", None, "sysfs"), ("AMD", "integrated", 512 * MiB, "sysfs")]
    assert report.cpu.cores_logical == 32


def test_garbage_command_output_and_probe_bugs_are_reported() -> None:
    report = detect_hardware(fixture_env("linux_nvidia", run=RecordedCommands({"nvidia-smi": "Segmentation fault\n"})))
    assert report.errors == ["gpu:nvidia-smi: nvidia-smi: unexpected output line 'Segmentation fault'"]

    def buggy() -> None:
        raise KeyError("providers")

    report = detect_hardware(fixture_env("linux_intel", onnx_providers=buggy))
    assert report.errors == ["onnxruntime: KeyError: 'providers'"]
    assert report.onnx_providers is None and report.npus


def test_missing_proc_files(tmp_path: Path) -> None:
    report = detect_hardware(fixture_env("linux_intel", root=tmp_path))
    assert sorted(report.errors) == ["cpu: /proc/cpuinfo is not readable", "memory: /proc/meminfo is not readable"]
    assert report.cpu.model == "x86_64 CPU" and report.gpus == [] and report.ram_total_bytes is None


@pytest.mark.parametrize(("limit_file", "usage_file"), [
    ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
    ("sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory/memory.usage_in_bytes"),
])
def test_container_memory_limit(tmp_path: Path, limit_file: str, usage_file: str) -> None:
    src = Path(__file__).resolve().parents[1] / "fixtures/hw/linux_intel/root/proc/meminfo"
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_bytes(src.read_bytes())
    (tmp_path / limit_file).parent.mkdir(parents=True)
    (tmp_path / limit_file).write_text("8589934592\n")
    (tmp_path / usage_file).write_text("2147483648\n")
    report = detect_hardware(fixture_env("linux_intel", root=tmp_path))
    assert (report.ram_total_bytes, report.ram_available_bytes) == (8 * GiB, 6 * GiB)
    (tmp_path / limit_file).write_text("max\n" if limit_file.endswith(".max") else "9223372036854771712\n")
    assert detect_hardware(fixture_env("linux_intel", root=tmp_path)).ram_total_bytes == 31_574_112 * 1024


def test_a_hung_probe_is_abandoned_at_the_deadline() -> None:
    release = threading.Event()

    def hung_runner(argv, timeout):
        release.wait(30)  # a wedged nvidia-smi that ignores its own timeout
        return ""

    try:
        report = detect_hardware(fixture_env("linux_nvidia", run=hung_runner), deadline_s=0.3)
    finally:
        release.set()
    assert report.errors == ["gpu:nvidia-smi: timed out after 0.3s"]
    assert report.cpu.cores_logical == 32 and len(report.gpus) == 2


def test_windows_without_registry_access() -> None:
    report = detect_hardware(fixture_env("windows_snapdragon", registry=None))
    assert sorted(report.errors) == ["gpu:registry: no registry access", "npu:registry: no registry access"]
    assert report.cpu.model == "arm64 CPU" and report.cpu.features == ["NEON", "DOTPROD"]


def test_intel_mac_has_no_metal_gpu() -> None:
    values = {"hw.optional.arm64": None, "machdep.cpu.brand_string": "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz",
              "hw.memsize": str(16 * GiB), "hw.physicalcpu": "8", "hw.logicalcpu": "16", "hw.optional.avx2_0": "1",
              "hw.optional.avx1_0": "1", "hw.optional.sse4_2": "1", "hw.optional.fma": "1"}
    report = detect_hardware(fixture_env("apple_m2_pro", machine="x86_64", sysctl=values.get))
    assert report.gpus == [] and report.npus == []
    assert (report.cpu.arch, report.cpu.features) == ("x86_64", ["SSE4.2", "AVX", "AVX2", "FMA"])


def test_raised_metal_wired_limit() -> None:
    from fixtures.hw.loader import _sysctl

    base = _sysctl(Path(__file__).resolve().parents[1] / "fixtures/hw/apple_m2_pro/sysctl.txt")
    report = detect_hardware(fixture_env("apple_m2_pro", sysctl=lambda k: "28672" if k == "iogpu.wired_limit_mb" else base(k)))
    assert report.gpus[0].vram_bytes == 28 * GiB


def test_llama_cpp_system_info_backends() -> None:
    cuda = "CUDA : ARCHS = 500,610,700,750,800,860,890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX2 = 1 | "
    assert parse_system_info(cuda) == ["CUDA"]
    assert parse_system_info("Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 | ") == ["Metal"]
    assert parse_system_info("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | ") == []


def test_render_shows_devices_runtimes_and_errors() -> None:
    report = detect_hardware(fixture_env("windows_snapdragon", onnx=["QNNExecutionProvider", "CPUExecutionProvider"]))
    report.errors.append("gpu:nvidia-smi: timed out after 10s")
    console = Console(width=250, record=True)
    console.print(render(report))
    text = console.export_text()
    for needle in ("Snapdragon(R) X Elite - X1E80100 - Qualcomm(R) Oryon(TM) CPU", "NEON DOTPROD",
                   "Qualcomm(R) Adreno(TM) X1-85 GPU", "Hexagon(TM) NPU", "EP QNNExecutionProvider",
                   "QNNExecutionProvider, CPUExecutionProvider", "CPU only", "timed out after 10s", "31.7 GiB total"):
        assert needle in text, needle


# --- the real machine ---------------------------------------------------------------------------

def test_this_machine() -> None:
    import llama_cpp

    report = detect_hardware()
    assert report.errors == []
    assert report.os == ProbeEnv().system
    assert report.cpu.cores_logical and report.cpu.cores_usable and report.ram_total_bytes
    assert report.llama_gpu_offload == bool(llama_cpp.llama_supports_gpu_offload())
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " in flags:
        assert "AVX2" in report.cpu.features


def test_hw_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["hw", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"cpu", "ram_total_bytes", "gpus", "npus", "onnx_providers", "llama_gpu_offload", "errors"} <= data.keys()


def test_hw_command_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["hw"]) == 0
    out = capsys.readouterr().out
    assert "localserve hardware" in out and "llama.cpp" in out and "RAM" in out
