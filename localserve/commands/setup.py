"""`localserve setup`: compile and install the llama-cpp-python build that fits this machine.

The wheel is built first (`pip wheel`) into a scratch directory and installed only once it built,
so a failed GPU build leaves the working build in place; pip's whole output goes to a log file
under the data directory, whose path every outcome names.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from ..runtime.buildinfo import (BUILDS, PACKAGE, Toolkits, build_env, installed_build, installed_version, pinned_version,
                         recommend)
from ..config.settings import Settings
from ..errors import LocalserveError
from ..hardware import HardwareReport, detect_hardware

# cmake's "[ 42%] Building ..." lines: the one progress figure a llama.cpp build prints.
_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]")


class SetupError(LocalserveError):
    code = "setup_error"


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("setup", parents=[common], help="build and install the llama.cpp build that fits this machine")
    p.add_argument("--build", choices=["auto", *BUILDS], default="auto", help="which build (default: auto, from the hardware)")
    p.add_argument("--dry-run", action="store_true", help="print what would run, change nothing")
    p.add_argument("--force", action="store_true", help="rebuild even if this build is already installed")
    p.set_defaults(func=run_setup)


def pip_commands(version: str, wheel_dir: Path, python: str = sys.executable) -> tuple[list[str], list[str]]:
    """The two steps: build the wheel from source, then install that wheel over the current one.

    --no-cache-dir: pip's wheel cache keys on the source archive, not on CMAKE_ARGS or CFLAGS, so a
    cached wheel of another flavour (the CPU one `pip install` built) would otherwise come back
    instead of a compile, and this build's wheel would be cached for later CPU installs."""
    # -v: pip shows a build backend's output only when verbose, and cmake's "[ 42%]" lines are the
    # progress shown while compiling.
    build = [python, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir", "--no-binary", PACKAGE,
             "--wheel-dir", str(wheel_dir), f"{PACKAGE}=={version}"]
    install = [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index",
               "--find-links", str(wheel_dir), f"{PACKAGE}=={version}"]
    return build, install


def choose_build(requested: str, report: HardwareReport, toolkits: Toolkits) -> tuple[str, str]:
    """(build, why). An explicit build whose toolkit is missing fails here, before any work."""
    if requested == "auto":
        rec = recommend(report, toolkits)
        return rec.build, rec.reason
    if not toolkits.has(requested):
        spec = BUILDS[requested]
        raise SetupError(f"the {requested} build needs {spec.toolkit}, which is not installed: {spec.how_to_get}")
    return requested, "requested"


def run_setup(args: argparse.Namespace, settings: Settings) -> int:
    console = Console(stderr=True)
    report = detect_hardware()
    toolkits = Toolkits.probe()
    build, why = choose_build(args.build, report, toolkits)
    version = pinned_version()
    if version is None:
        raise SetupError(f"localserve's metadata names no pinned {PACKAGE} version; reinstall localserve")
    current = installed_build(report)
    for line in recommend(report, toolkits).missing if args.build == "auto" else []:
        console.print(f"[yellow]note[/] {line}")
    if current == build and not args.force and installed_version() == version:
        console.print(f"{PACKAGE} {version} ({build} build) is already installed ({why}).")
        return 0
    env = build_env(build, report)
    log = settings.home / "logs" / f"setup-{build}-{datetime.datetime.now():%Y%m%d-%H%M%S}.log"
    with tempfile.TemporaryDirectory(prefix="localserve-setup-") as scratch:
        build_cmd, install_cmd = pip_commands(version, Path(scratch))
        if args.dry_run:
            print(f"build: {build} ({why}); installed: {current or 'none'}")
            print(" ".join(f"{k}={shlex.quote(env[k])}" for k in ("CMAKE_ARGS", "CFLAGS", "CXXFLAGS", "FORCE_CMAKE") if env.get(k)))
            print(shlex.join(build_cmd))
            print(shlex.join(install_cmd))
            return 0
        log.parent.mkdir(parents=True, exist_ok=True)
        console.print(f"Building {PACKAGE} {version} for {build} ({why}); this compiles llama.cpp and takes "
                      f"minutes. Log: {log}")
        if _run_logged(build_cmd, env, log, console) != 0:
            raise SetupError(f"the {build} build of {PACKAGE} failed ({_last_error(log)}); the installed "
                             f"{current or 'no'} build is unchanged. Full log: {log}")
        if _run_logged(install_cmd, env, log, console) != 0:
            raise SetupError(f"installing the built {build} wheel failed; full log: {log}")
    console.print(f"Installed the {build} build of {PACKAGE} {version}. Check it with `localserve hw`.")
    return 0


def _run_logged(cmd: list[str], env: dict[str, str], log: Path, console: Console) -> int:
    """Run `cmd` with its output appended to `log`, showing the build's percentage and elapsed time."""
    start = time.monotonic()
    with log.open("a", encoding="utf-8") as out, console.status("starting") as status:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        percent = "…"
        for line in proc.stdout:
            out.write(line)
            if m := _PERCENT.match(line):
                percent = f"{m.group(1)}%"
            status.update(f"{percent} compiled, {time.monotonic() - start:.0f}s")
        return proc.wait()


def _last_error(log: Path) -> str:
    """The first compiler or CMake error line: what a reader of the log would look for."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    for line in lines:
        if re.search(r"(?i)(error:|cmake error|could not find)", line):
            return line.strip()[:200]
    return "see the log"
