"""Which llama.cpp build fits a machine (recorded hardware fixtures), what placement does with that
build, and `localserve setup` / `hw` run for real on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from fixtures.hw.loader import fixture_env
from localserve.runtime.buildinfo import NO_AMX_FLAGS, Toolkits, build_env, installed_build, pinned_version, recommend
from localserve.commands.setup import pip_commands
from localserve.hardware import CPUInfo, HardwareReport, detect_hardware
from localserve.runtime.placement import Runtimes, choose_backend
from wheel_cache import wheel_of_this_build

REPO = Path(__file__).resolve().parents[2]

ALL = Toolkits(nvcc=True, hipcc=True, vulkan_loader=True, glslc=True, xcode=True)
VULKAN_ONLY = Toolkits(vulkan_loader=True, glslc=True)
API = {"cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "metal": "Metal"}

# case, toolkits -> recommended build, the GPU it offloads to (None: CPU), better builds blocked
CASES = [
    ("linux_nvidia", ALL, "cuda", "NVIDIA GeForce RTX 4090", []),
    ("linux_nvidia", VULKAN_ONLY, "vulkan", "NVIDIA GeForce RTX 4090", ["cuda"]),
    ("linux_nvidia", Toolkits(), "cpu", None, ["cuda", "vulkan"]),
    ("linux_amd", ALL, "rocm", "AMD Navi 31", []),
    ("linux_amd", VULKAN_ONLY, "vulkan", "AMD Navi 31", ["rocm"]),
    ("linux_strix_halo", ALL, "rocm", "AMD GPU [1002:1586]", []),
    ("linux_strix_halo", VULKAN_ONLY, "vulkan", "AMD GPU [1002:1586]", ["rocm"]),
    ("apple_m2_pro", ALL, "metal", "Apple M2 Pro GPU", []),
    ("apple_m2_pro", Toolkits(), "cpu", None, ["metal"]),
    ("windows_nvidia", ALL, "cuda", "NVIDIA GeForce RTX 3060", []),
    # A Meteor Lake iGPU and a Snapdragon Adreno share system memory with no carve-out: no offload
    # target for llama.cpp, so no toolkit is worth asking for.
    ("linux_intel", ALL, "cpu", None, []),
    ("windows_snapdragon", ALL, "cpu", None, []),
]


@pytest.mark.parametrize(("case", "toolkits", "build", "gpu", "blocked"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_recommendation_then_placement_with_that_build(case, toolkits, build, gpu, blocked) -> None:
    # The machine as recorded but with a CPU-only llama.cpp: what `setup` would change.
    report = detect_hardware(fixture_env(case, llama=(False, [])))
    rec = recommend(report, toolkits)
    assert rec.build == build
    assert [line.split(":")[0] for line in rec.missing] == blocked
    assert all("needs" in line and ("install" in line or "xcode-select" in line) for line in rec.missing)
    # After that build is installed (the fixture's llama.cpp now reports its backend), placement
    # offloads every layer of a model of unknown size to the GPU the recommendation named.
    after = detect_hardware(fixture_env(case, llama=(build != "cpu", [API[build]] if build in API else [])))
    assert installed_build(after) == build
    choice = choose_backend(after, ["gguf"], Runtimes.from_report(after), None)
    if gpu is None:
        assert choice.device == "cpu"
    else:
        assert choice.device == "gpu:0" and choice.n_gpu_layers == -1 and gpu in choice.device_name


@pytest.mark.parametrize(("llama", "expected"), [
    ((True, ["CUDA"]), "cuda"), ((True, ["ROCm"]), "rocm"), ((True, ["Vulkan"]), "vulkan"),
    ((True, ["Metal"]), "metal"), ((False, []), "cpu"), (None, None),
])
def test_installed_build_from_the_backends_llama_reports(llama, expected) -> None:
    assert installed_build(detect_hardware(fixture_env("linux_nvidia", llama=llama))) == expected


def _cpu_report(arch: str, features: list[str]) -> HardwareReport:
    return HardwareReport("Linux", CPUInfo("x", arch, 2, 2, 2, features), None, None)


def test_build_env_guards_amx_only_where_cpuid_claims_it() -> None:
    env = build_env("vulkan", _cpu_report("x86_64", ["AVX2", "AMX"]), {"CFLAGS": "-O2"})
    assert env["CMAKE_ARGS"] == "-DGGML_VULKAN=on" and env["FORCE_CMAKE"] == "1"
    assert env["CFLAGS"] == f"-O2 {NO_AMX_FLAGS}" and env["CXXFLAGS"] == NO_AMX_FLAGS
    for report in (_cpu_report("x86_64", ["AVX2"]), _cpu_report("arm64", ["NEON", "AMX"])):
        env = build_env("cpu", report, {})
        assert "CFLAGS" not in env and env["CMAKE_ARGS"] == ""


def test_pip_commands_build_without_the_wheel_cache_then_install_only_that_wheel(tmp_path: Path) -> None:
    build, install = pip_commands("0.3.36", tmp_path, python="py")
    assert build[:3] == ["py", "-m", "pip"] and "wheel" in build and "--no-cache-dir" in build
    assert build[-1] == "llama-cpp-python==0.3.36" and str(tmp_path) in build
    assert "--no-index" in install and "--force-reinstall" in install and str(tmp_path) in install


def _cli(*args: str, env: dict[str, str] | None = None, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localserve", "--home", str(home), *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_hw_json_carries_the_build_and_the_recommendation(tmp_path: Path) -> None:
    done = _cli("hw", "--json", home=tmp_path)
    assert done.returncode == 0, done.stderr
    build = json.loads(done.stdout)["llama_build"]
    assert build["installed"] in {"cpu", "cuda", "rocm", "vulkan", "metal", "gpu"}
    assert build["version"] == pinned_version()
    assert build["recommended"]["build"] in {"cpu", "cuda", "rocm", "vulkan", "metal"}
    assert build["command"] in (None, f"localserve setup --build {build['recommended']['build']}")


def test_setup_names_a_missing_toolkit_before_any_work(tmp_path: Path) -> None:
    # No hipcc on PATH or under ROCM_PATH: the ROCm build cannot start, and nothing is written.
    done = _cli("setup", "--build", "rocm", env={"PATH": str(Path(sys.executable).parent),
                                                 "ROCM_PATH": str(tmp_path / "no-rocm")}, home=tmp_path)
    assert done.returncode == 1
    assert "the rocm build needs ROCm with hipcc, which is not installed: install ROCm" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "logs").exists()


def test_failed_build_keeps_the_installed_build_and_names_the_log(tmp_path: Path) -> None:
    record = next(f for f in metadata.files("llama-cpp-python") if f.name == "RECORD").locate()
    before = Path(record).stat().st_mtime_ns
    # pip cannot reach any source of llama-cpp-python: the wheel step fails, the install never runs.
    done = _cli("setup", "--build", "cpu", "--force", env={"PIP_NO_INDEX": "1"}, home=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    logs = list((tmp_path / "logs").glob("setup-cpu-*.log"))
    assert len(logs) == 1 and str(logs[0]) in done.stderr.replace("\n", "")
    assert "the cpu build of llama-cpp-python failed (ERROR: Could not find a version" in done.stderr
    assert "the installed cpu build is unchanged" in done.stderr
    assert Path(record).stat().st_mtime_ns == before
    assert "-m pip wheel" in logs[0].read_text()


def test_setup_dry_run_prints_the_plan(tmp_path: Path) -> None:
    done = _cli("setup", "--build", "cpu", "--force", "--dry-run", home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--no-cache-dir" in done.stdout and f"llama-cpp-python=={pinned_version()}" in done.stdout
    assert not (tmp_path / "logs").exists()


@pytest.fixture
def wheel_folder(tmp_path: Path) -> Path:
    """A folder holding the llama-cpp-python wheel this machine built (pip's cache, as CI keeps it)."""
    folder = tmp_path / "wheels"
    if wheel_of_this_build(folder) is None:
        pytest.skip("pip's cache holds no wheel of the installed llama-cpp-python build (CI's install puts it there)")
    return folder


def test_setup_installs_a_prebuilt_wheel_without_compiling(tmp_path: Path, wheel_folder: Path) -> None:
    """Into a fresh environment, from a local wheel folder with every index off: installed, and the
    log shows pip fetched a wheel and never built one."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # localserve and its dependencies come from this checkout and the dev environment; pip installs
    # into the fresh one (it leaves the dev environment's llama-cpp-python alone: outside it).
    dev_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "llama_cpp").is_dir())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), dev_site]), "PIP_NO_INDEX": "1"}
    done = subprocess.run([str(python), "-m", "localserve", "--home", str(tmp_path / "home"), "setup", "--build", "cpu",
                           "--force", "--wheels", str(wheel_folder)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())  # rich wraps its lines
    assert "Installed the prebuilt cpu build of llama-cpp-python" in said and "nothing was compiled" in said
    installed = list((venv / "lib").glob(f"python3*/site-packages/llama_cpp_python-{pinned_version()}.dist-info"))
    assert len(installed) == 1
    log = next((tmp_path / "home" / "logs").glob("setup-cpu-*.log")).read_text()
    assert "-m pip download" in log and "-m pip wheel" not in log


def test_setup_refuses_a_wheel_of_another_flavour_and_names_the_toolkit(tmp_path: Path, wheel_folder: Path) -> None:
    """The CPU wheel offered for a ROCm build is read for what it is; without hipcc nothing compiles
    either, and the refusal says both."""
    done = _cli("setup", "--build", "rocm", "--wheels", str(wheel_folder),
                env={"PATH": str(Path(sys.executable).parent), "ROCM_PATH": str(tmp_path / "no-rocm"), "PIP_NO_INDEX": "1"},
                home=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert f"its llama-cpp-python {pinned_version()} wheel is a cpu build, not rocm" in message
    assert "the rocm build needs ROCm with hipcc to compile, which is not installed" in message
    assert "Traceback" not in done.stderr
