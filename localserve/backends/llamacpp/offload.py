"""What a llama.cpp load put on the GPU: layers and device memory.

llama.cpp's C API says neither how many layers a load offloaded nor how much device memory its
buffers took: both exist only as the loader's log lines ("offloaded 31/31 layers to GPU",
"Vulkan0 model buffer size = 83.72 MiB", "... KV buffer size", "... compute buffer size").
`parse_load_log` reads them from the lines llamacpp_runtime.captured_log collected during the load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

_MIB = 1024 * 1024
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
# "load_tensors:      Vulkan0 model buffer size =    83.72 MiB"; KV, compute, output and RS alike.
_BUFFER = re.compile(r":\s+(\S+)\s+(model|KV|compute|output|RS) buffer size = +([\d.]+) MiB")
# A debug line per weight a buffer-type override moved (moe.py): "tensor blk.0.ffn_up_exps.weight
# (0 MiB f16) buffer type overridden to CPU" (CPU_REPACK where a repacked layout was chosen).
_OVERRIDDEN = re.compile(r"tensor (\S+) \(\d+ MiB \S+\) buffer type overridden to (\S+)")
# A debug line per layer, the output layer counted as one (as "offloaded N/M" counts it):
# "load_tensors: layer  12 assigned to device Vulkan1, is_swa = 0".
_LAYER_DEVICE = re.compile(r"layer +\d+ assigned to device (\S+?),")


def _on_device(buffer: str) -> bool:
    """A buffer in device memory: not host RAM ("CPU", "CPU_Mapped", "CPU_REPACK") and not a GPU
    backend's pinned host staging buffer ("Vulkan_Host", "CUDA_Host")."""
    return not buffer.startswith("CPU") and not buffer.endswith("_Host")


@dataclass
class OffloadFacts:
    """Layers a load offloaded and the device memory its buffers hold, as llama.cpp logged them."""

    gpu_layers: int = 0  # layers on the GPU (the output layer counts as one, as llama.cpp counts)
    offloadable_layers: int = 0  # repeating layers + output; 0 when the build has no GPU offload
    device_bytes: dict[str, int] = field(default_factory=dict)  # per kind: model, KV, compute, ...
    devices: list[str] = field(default_factory=list)  # buffer names seen on devices ("Vulkan0")
    bytes_by_device: dict[str, int] = field(default_factory=dict)  # all kinds, per device ("CUDA1")
    overridden: dict[str, str] = field(default_factory=dict)  # weight -> buffer type an override chose
    layers_by_device: dict[str, int] = field(default_factory=dict)  # layers per device ("CPU" too)

    @property
    def moe_layers_in_ram(self) -> int:
        """Layers with a weight an override moved to a CPU buffer (the override is cpu_moe's)."""
        return len({name.split(".")[1] for name, buft in self.overridden.items()
                    if name.startswith("blk.") and buft.startswith("CPU")})

    @property
    def gpu_memory_bytes(self) -> int:
        return sum(self.device_bytes.values())


def parse_load_log(lines: Iterable[str]) -> OffloadFacts:
    facts = OffloadFacts()
    requested = 0
    for line in lines:
        if m := _OVERRIDDEN.search(line):
            facts.overridden[m.group(1)] = m.group(2)
        elif m := _LAYER_DEVICE.search(line):
            facts.layers_by_device[m.group(1)] = facts.layers_by_device.get(m.group(1), 0) + 1
        elif m := _OFFLOADED.search(line):
            requested, facts.offloadable_layers = int(m.group(1)), int(m.group(2))
        elif (m := _BUFFER.search(line)) and _on_device(m.group(1)):
            kind = m.group(2)
            facts.device_bytes[kind] = facts.device_bytes.get(kind, 0) + round(float(m.group(3)) * _MIB)
            if m.group(1) not in facts.devices:
                facts.devices.append(m.group(1))
            facts.bytes_by_device[m.group(1)] = (facts.bytes_by_device.get(m.group(1), 0)
                                                 + round(float(m.group(3)) * _MIB))
    # A GPU build with no usable device (ggml's Vulkan backend skips CPU-type devices) still logs
    # "offloaded N/M" for the layers it was asked for: they ran on the CPU unless a device buffer exists.
    facts.gpu_layers = requested if facts.device_bytes.get("model") else 0
    return facts
