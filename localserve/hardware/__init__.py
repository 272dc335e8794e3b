"""What the machine has -> HardwareReport: CPU, RAM, GPUs, NPUs and the runtimes that can use them.

One small module per probe family (cpu, linux sysfs, nvidia-smi, windows registry, apple sysctl,
runtimes), all reading the machine through an injectable `ProbeEnv`.
"""

from .detect import detect_hardware
from .env import ProbeEnv, ProbeError
from .report import CPUInfo, GPUInfo, HardwareReport, NPUInfo
from .runtimes import LlamaBuild

__all__ = [
    "CPUInfo", "GPUInfo", "HardwareReport", "LlamaBuild", "NPUInfo", "ProbeEnv", "ProbeError", "detect_hardware",
]
