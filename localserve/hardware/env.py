"""Everything a probe may touch, behind one injectable object.

Probes never call `open("/sys/...")`, `subprocess` or `winreg` directly: they go through a
`ProbeEnv`, so tests run the same probes over a fixture tree, canned command outputs, a registry
dump and a sysctl dump recorded on other machines (NVIDIA, AMD, Intel, Apple, Snapdragon).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from .ggml import GgmlDevice, probe_ggml_devices
from .runtimes import LlamaBuild, probe_llama, probe_onnxruntime

DEFAULT_TIMEOUT = 5.0


class ProbeError(Exception):
    """A probe could not answer; becomes one line in HardwareReport.errors."""


class CommandRunner(Protocol):
    def __call__(self, argv: Sequence[str], timeout: float) -> str | None:
        """stdout of the command; None when the program is not installed; ProbeError on failure."""


class RegistryReader(Protocol):
    """Read-only view of HKEY_LOCAL_MACHINE; paths use backslashes, relative to HKLM."""

    def subkeys(self, path: str) -> list[str]: ...

    def values(self, path: str) -> dict[str, Any]: ...


def run_command(argv: Sequence[str], timeout: float) -> str | None:
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    # CREATE_NO_WINDOW: the tray app runs `hw` probes without a console; nvidia-smi would flash one.
    flags = getattr(subprocess, "CREATE_NO_WINDOW", 0) if sys.platform == "win32" else 0
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout,
                              creationflags=flags, errors="replace")
    except subprocess.TimeoutExpired:
        raise ProbeError(f"{argv[0]} did not answer within {timeout:g}s") from None
    except OSError as e:
        raise ProbeError(f"{argv[0]} could not run: {e.strerror or e}") from None
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()
        raise ProbeError(f"{argv[0]} failed (exit {done.returncode}): {first[0] if first else 'no output'}")
    return done.stdout


class WinRegistry:
    """HKLM through `winreg` (Windows only)."""

    def __init__(self) -> None:
        import winreg  # noqa: PLC0415 - Windows only

        self._winreg = winreg

    def _open(self, path: str) -> Any:
        w = self._winreg
        return w.OpenKey(w.HKEY_LOCAL_MACHINE, path, 0, w.KEY_READ | w.KEY_WOW64_64KEY)

    def subkeys(self, path: str) -> list[str]:
        names = []
        with self._open(path) as key:
            i = 0
            while True:
                try:
                    names.append(self._winreg.EnumKey(key, i))  # type: ignore[attr-defined,unused-ignore]
                except OSError:  # ERROR_NO_MORE_ITEMS
                    return names
                i += 1

    def values(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with self._open(path) as key:
            i = 0
            while True:
                try:
                    name, value, _ = self._winreg.EnumValue(key, i)  # type: ignore[attr-defined,unused-ignore]
                except OSError:
                    return out
                out[name] = value
                i += 1


def _sysctl(env: "ProbeEnv") -> Callable[[str], str | None]:
    # The cpu, memory, gpu and npu probes ask for the same few keys (hw.optional.arm64,
    # machdep.cpu.brand_string, hw.memsize): run `sysctl` once per key.
    answers: dict[str, str | None] = {}

    def read(key: str) -> str | None:
        if key not in answers:
            try:
                out = env.run(["sysctl", "-n", key], env.timeout)
            except ProbeError:  # unknown key: sysctl exits 1
                out = None
            answers[key] = out.strip() if out is not None else None
        return answers[key]

    return read


def _memory() -> tuple[int | None, int | None]:
    import psutil  # noqa: PLC0415 - only the live machine needs it

    vm = psutil.virtual_memory()
    return vm.total, vm.available


def _cpu_counts() -> tuple[int | None, int | None]:
    import psutil  # noqa: PLC0415

    return psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)


def _usable_cpus() -> int | None:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _processor_feature(feature: int) -> bool:
    import ctypes  # noqa: PLC0415

    return bool(ctypes.windll.kernel32.IsProcessorFeaturePresent(feature))  # type: ignore[attr-defined]


@dataclass
class ProbeEnv:
    system: str = field(default_factory=platform.system)  # "Linux" | "Windows" | "Darwin"
    machine: str = field(default_factory=platform.machine)  # "x86_64", "AMD64", "arm64", "ARM64", "aarch64"
    root: Path = Path("/")
    run: CommandRunner = run_command
    registry: RegistryReader | None = None
    sysctl: Callable[[str], str | None] | None = None
    memory: Callable[[], tuple[int | None, int | None]] = _memory
    cpu_counts: Callable[[], tuple[int | None, int | None]] = _cpu_counts
    usable_cpus: Callable[[], int | None] = _usable_cpus
    processor_feature: Callable[[int], bool] | None = None  # Windows IsProcessorFeaturePresent
    llama_build: Callable[[], LlamaBuild] = probe_llama
    onnx_providers: Callable[[], list[str] | None] = probe_onnxruntime
    ggml_devices: Callable[[], list[GgmlDevice]] = probe_ggml_devices
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        if self.sysctl is None:
            self.sysctl = _sysctl(self)
        if self.system == "Windows":
            if self.registry is None and sys.platform == "win32":
                self.registry = WinRegistry()
            if self.processor_feature is None and sys.platform == "win32":
                self.processor_feature = _processor_feature

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*[p.lstrip("/") for p in parts])

    def read_text(self, *parts: str) -> str | None:
        """A sysfs/procfs file's content, or None when it does not exist or cannot be read."""
        try:
            return self.path(*parts).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    @property
    def arch(self) -> str:
        m = self.machine.lower()
        return {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64"}.get(m, m)
