"""Does this llama.cpp build's CPU path survive a real decode on this machine? Asked once, in a child.

Why: pip compiles llama.cpp with -march=native. Some x86-64 VMs say AMX is there (cpuid, XCR0, and
the kernel grants ARCH_REQ_XCOMP_PERM for XTILEDATA) and then fault on the tile instructions. ggml
then builds its AMX matmul, puts the weights into AMX buffers at load ("AMX model buffer size = ..."
in the log), and the first prompt kills the process: SIGILL, or a general protection fault in
libggml-cpu.so (seen on this project's CI machines, where README's first command died with "the
daemon closed the stream before it finished"). Nothing short of running those kernels tells, and a
daemon that runs them dies with every other model and stream it holds.

So before the first load with a given build on a CPU that claims AMX, a child process loads the
model and decodes a prompt of a few dozen tokens. If the child dies from a signal, later loads turn
llama.cpp's extra buffer types off (`use_extra_bufts = false`): the weights stay in plain CPU
buffers and the AMX kernels never run. The same switch also turns off the CPU repack layouts
(Q4_0 / IQ4_NL / Q4_K weights interleaved for AVX2/AVX-512 gemm), which is the fallback's cost.
The verdict is kept per build (the libggml-cpu files' hash) and CPU in the user's cache directory,
one file each, so the probe's price is paid once per machine and build: it is a fact about them, not
about a data home, and every LOCALSERVE_HOME on the machine (the installer's, a developer's, each
test's) reads the same one. A CPU that does not claim AMX, or a build without it, is never probed.
A load that does not say whether to use extra buffer types (LlamaCppBackend.load's default: tools,
benchmarks, tests) follows this build's recorded verdict too, without probing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import platformdirs

log = logging.getLogger(__name__)

# One file per build and CPU ("BUILD-CPU.json"): the installer's environment and a developer's hold
# other builds on the same machine. Read at each call, so tests can point it elsewhere.
VERDICT_DIR = Path(platformdirs.user_cache_dir("localserve")) / "native-probe"
PROBE_TOKENS = 48  # the crash came in "the first prompt of a few dozen tokens"
PROBE_TIMEOUT_S = 600.0  # a 30 GB model's first load from a cold disk is minutes, not hours


@dataclass(frozen=True)
class Verdict:
    """What the probe saw for one build on one CPU."""

    key: str
    ok: bool  # False: the child died from a signal; load without extra buffer types
    signal: str | None = None  # "SIGILL", "SIGSEGV", ...
    seconds: float = 0.0  # what the probe cost
    checked_at: float = 0.0

    def describe(self) -> str:
        if self.ok:
            return f"llama.cpp's AMX path was probed on this CPU and runs ({self.seconds:.1f} s, once)"
        return (f"llama.cpp's AMX path died with {self.signal} on this CPU (this machine claims AMX but does not run "
                "it): models load without llama.cpp's extra buffer types (no AMX, no repacked weights); "
                "`localserve setup` builds llama.cpp without AMX")


@functools.lru_cache(maxsize=1)
def build_uses_amx() -> bool:
    """Whether the installed llama.cpp build compiled ggml's AMX kernels ("AMX_INT8 = 1")."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return any(part.strip().startswith("AMX") and part.strip().endswith("= 1") for part in info.split("|"))


def _cpu_libraries() -> list[Path]:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib.glob("libggml-cpu*")) or sorted(lib.glob("libggml*"))
    return sorted({path.resolve() for path in found})  # the .so, .so.0 links name one file


@functools.lru_cache(maxsize=1)
def _build_digest() -> str:
    """The installed build (its CPU libraries' bytes); hashed once, as the loaded library is the one
    this process keeps even if pip replaces the files under it."""
    digest = hashlib.sha256()
    for path in _cpu_libraries():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_key(cpu_model: str, cpu_features: Sequence[str]) -> str:
    """The build and the CPU (the hardware report's model and features): a new build, or the same
    cache directory on another machine, is probed again."""
    cpu = hashlib.sha256(f"{cpu_model}\n{' '.join(cpu_features)}".encode()).hexdigest()[:16]
    return f"{_build_digest()}-{cpu}"


def needs_probe(cpu_features: Sequence[str]) -> bool:
    """A CPU that claims AMX (hardware/cpu.py names the amx_tile flag "AMX") and a build that uses it."""
    return "AMX" in cpu_features and build_uses_amx()


def read_verdict(key: str) -> Verdict | None:
    """The recorded verdict for this build and CPU (`key`), or None (never probed, or another build)."""
    return _read(VERDICT_DIR / f"{key}.json", key)


def _read(path: Path, key: str | None = None) -> Verdict | None:
    try:
        verdict = Verdict(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    return verdict if key is None or verdict.key == key else None


def build_died_here() -> bool:
    """Whether a probe of the installed build died on this machine: the default of a load that does
    not say (LlamaCppBackend.load), which knows no hardware report and so reads any CPU's verdict
    for this build in this machine's cache. Never probes."""
    if not build_uses_amx():
        return False
    return any(not verdict.ok for path in VERDICT_DIR.glob(f"{_build_digest()}-*.json")
               if (verdict := _read(path)) is not None)


def probe(model_path: Path, key: str, command: list[str] | None = None, timeout: float = PROBE_TIMEOUT_S) -> Verdict | None:
    """Load `model_path` and decode a short prompt in a child process (`command` replaces the child's
    argv: tests run the real probe under a harness that kills it).

    A verdict when the child ran to its end or died from a signal; None when it could not tell (the
    model failed to load with an error of its own, which the real load will report)."""
    argv = command or [sys.executable, "-m", f"{__package__}.probe_child", os.fspath(model_path)]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        code = done.returncode
    except subprocess.TimeoutExpired:
        # A hung kernel would hang the daemon's engine thread too: treated as a failed build.
        log.warning("the llama.cpp probe did not finish within %.0f s", timeout)
        code = -signal.SIGKILL
    seconds = time.monotonic() - started
    if code == 0:
        return Verdict(key, True, seconds=round(seconds, 2), checked_at=time.time())
    if code < 0:
        name = _signal_name(-code)
        log.error("llama.cpp died with %s in a probe load of %s: loading without extra buffer types (AMX, "
                  "repacked weights) from now on for this build", name, model_path.name)
        return Verdict(key, False, signal=name, seconds=round(seconds, 2), checked_at=time.time())
    log.info("the llama.cpp probe could not load %s (exit %d): no verdict", model_path.name, code)
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def extra_buffers_allowed(model_path: Path, cpu_model: str, cpu_features: Sequence[str]) -> bool:
    """Whether a load here may use llama.cpp's extra buffer types: probed first where it could kill us."""
    if not needs_probe(cpu_features):
        return True
    key = build_key(cpu_model, cpu_features)
    verdict = read_verdict(key)
    if verdict is None:
        log.info("this CPU claims AMX and llama.cpp was built with it: probing it in a child process first")
        verdict = probe(model_path, key)
        if verdict is None:
            return True
        from ...store.cache import atomic_write_json

        VERDICT_DIR.mkdir(parents=True, exist_ok=True)
        atomic_write_json(VERDICT_DIR / f"{key}.json", asdict(verdict))
    return verdict.ok


def condition(cpu_model: str, cpu_features: Sequence[str]) -> str | None:
    """One line for `hw` and `show` where this machine has the condition, else None."""
    if "AMX" not in cpu_features:
        return None
    if not build_uses_amx():
        return "this CPU claims AMX; the installed llama.cpp build was compiled without it (nothing to probe)"
    verdict = read_verdict(build_key(cpu_model, cpu_features))
    if verdict is None:
        return ("this CPU claims AMX and the llama.cpp build uses it: the first load probes it in a child process, "
                "since some VMs advertise AMX and trap it")
    return verdict.describe()
