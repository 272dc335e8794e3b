"""CPU model, core counts and the ISA features llama.cpp's kernels care about; and RAM."""

from __future__ import annotations

from .env import ProbeEnv
from .report import CPUInfo

# /proc/cpuinfo flag -> the name users know. Order = display order.
X86_FLAGS = {
    "sse4_2": "SSE4.2", "avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C",
    "avx_vnni": "AVX-VNNI", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI",
    "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX",
}
ARM_FLAGS = {
    "asimd": "NEON", "fphp": "FP16", "asimddp": "DOTPROD", "i8mm": "I8MM", "bf16": "BF16",
    "sve": "SVE", "sve2": "SVE2", "sme": "SME",
}
# macOS sysctl keys (hw.optional.*) -> feature names.
DARWIN_KEYS = {
    "hw.optional.neon": "NEON", "hw.optional.arm.FEAT_FP16": "FP16", "hw.optional.arm.FEAT_DotProd": "DOTPROD",
    "hw.optional.arm.FEAT_I8MM": "I8MM", "hw.optional.arm.FEAT_BF16": "BF16", "hw.optional.arm.FEAT_SME": "SME",
    "hw.optional.sse4_2": "SSE4.2", "hw.optional.avx1_0": "AVX", "hw.optional.avx2_0": "AVX2",
    "hw.optional.fma": "FMA", "hw.optional.avx512f": "AVX-512",
}
# Windows IsProcessorFeaturePresent constants (winnt.h PF_*).
WINDOWS_FEATURES = {
    38: "SSE4.2", 39: "AVX", 40: "AVX2", 41: "AVX-512",
    19: "NEON", 43: "DOTPROD",
}
CENTRAL_PROCESSOR = r"HARDWARE\DESCRIPTION\System\CentralProcessor\0"


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
            cur = {}
            continue
        key, _, value = line.partition(":")
        cur[key.strip()] = value.strip()
    if cur:
        blocks.append(cur)
    return blocks


def probe_cpu_linux(env: ProbeEnv) -> CPUInfo:
    text = env.read_text("proc/cpuinfo")
    if text is None:
        raise RuntimeError("/proc/cpuinfo is not readable")
    blocks = _cpuinfo_blocks(text)
    procs = [b for b in blocks if "processor" in b]
    header = next((b for b in blocks if "Hardware" in b or "Model" in b), {})
    first = procs[0] if procs else {}
    model = first.get("model name") or header.get("Model") or header.get("Hardware")
    if not model:  # arm64 cpuinfo has no model name; boards name themselves in the device tree
        dt = env.read_text("proc/device-tree/model") or env.read_text("sys/firmware/devicetree/base/model")
        model = dt.strip("\0\n ") if dt else f"{env.arch} CPU"
    cores = {(b.get("physical id", "0"), b["core id"]) for b in procs if "core id" in b}
    flags = set((first.get("flags") or first.get("Features") or "").split())
    table = ARM_FLAGS if env.arch == "arm64" else X86_FLAGS
    return CPUInfo(
        model=model,
        arch=env.arch,
        cores_physical=len(cores) or len(procs) or None,
        cores_logical=len(procs) or None,
        cores_usable=env.usable_cpus(),
        features=[name for flag, name in table.items() if flag in flags],
    )


def probe_cpu_darwin(env: ProbeEnv) -> CPUInfo:
    assert env.sysctl is not None
    sysctl = env.sysctl

    def num(key: str) -> int | None:
        value = sysctl(key)
        return int(value) if value and value.strip().isdigit() else None

    arm = num("hw.optional.arm64") == 1
    return CPUInfo(
        model=sysctl("machdep.cpu.brand_string") or "Apple CPU",
        arch="arm64" if arm else env.arch,
        cores_physical=num("hw.physicalcpu"),
        cores_logical=num("hw.logicalcpu"),
        cores_usable=num("hw.logicalcpu"),
        features=[name for key, name in DARWIN_KEYS.items() if num(key) == 1],
    )


def probe_cpu_windows(env: ProbeEnv) -> CPUInfo:
    model = None
    if env.registry is not None:
        name = env.registry.values(CENTRAL_PROCESSOR).get("ProcessorNameString")
        model = name.strip() if isinstance(name, str) else None
    physical, logical = env.cpu_counts()
    features: list[str] = []
    if env.processor_feature is not None:
        features = [name for pf, name in WINDOWS_FEATURES.items() if env.processor_feature(pf)]
        order = list(X86_FLAGS.values()) + list(ARM_FLAGS.values())
        features.sort(key=order.index)
    return CPUInfo(
        model=model or f"{env.arch} CPU",
        arch=env.arch,
        cores_physical=physical,
        cores_logical=logical,
        cores_usable=env.usable_cpus(),
        features=features,
    )


# cgroup memory limit and usage files as a container sees them: v2, then v1.
CGROUP_MEMORY = (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
                 ("sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _cgroup_limit(env: ProbeEnv) -> tuple[int, int] | None:
    """(limit, usage) of this container's memory cgroup, if it has a limit. /proc/meminfo shows the
    host's RAM inside Docker, so a model sized by it gets the container OOM-killed instead."""
    for limit_file, usage_file in CGROUP_MEMORY:
        limit = (env.read_text(limit_file) or "").strip()
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / 0x7FFF...F000: no limit
            usage = (env.read_text(usage_file) or "0").strip()
            return int(limit), int(usage) if usage.isdigit() else 0
    return None


def probe_memory(env: ProbeEnv) -> tuple[int | None, int | None]:
    """(total, available) bytes. Linux reads /proc/meminfo under the probe root (what psutil reads
    too), so fixture trees carry their own RAM, capped by a container's cgroup limit; macOS takes
    the total from hw.memsize."""
    if env.system == "Linux":
        text = env.read_text("proc/meminfo")
        if text is None:
            raise RuntimeError("/proc/meminfo is not readable")
        kib = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                kib[key] = int(parts[0]) * 1024
        total, available = kib.get("MemTotal"), kib.get("MemAvailable", kib.get("MemFree"))
        cgroup = _cgroup_limit(env)
        if cgroup and total and cgroup[0] < total:
            limit, usage = cgroup
            total, available = limit, min(available or limit, max(0, limit - usage))
        return total, available
    total, available = env.memory()
    if env.system == "Darwin" and env.sysctl is not None:
        memsize = env.sysctl("hw.memsize")
        if memsize and memsize.isdigit():
            total = int(memsize)
    return total, available
