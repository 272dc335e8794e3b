"""`localserve setup`: install the llama-cpp-python build that fits this machine.

A prebuilt wheel comes first: each source the user named (`--wheels`, the llama_wheels setting;
runtime/wheels.py) is asked for the pinned version, and a wheel of the right flavour is installed
without compiling, even where the build's toolkit is missing. Otherwise the wheel is built (`pip
wheel`) into a scratch directory and installed only once it built, so a failed GPU build leaves the
working build in place. pip's whole output goes to a log file under the data directory, whose path
every outcome names.
"""

from __future__ import annotations

import argparse
import datetime
import os
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
from ..runtime.wheels import WheelSource, find_wheel, parse_sources
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
    p.add_argument("--wheels", action="append", default=[], metavar="[BUILD=]SOURCE",
                   help="a folder of wheels, a find-links page or a package index to take a prebuilt build from "
                        "before compiling (repeatable; also the llama_wheels setting)")
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
    return build, install_command(version, wheel_dir, python)


def install_command(version: str, wheel_dir: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index",
            "--find-links", str(wheel_dir), f"{PACKAGE}=={version}"]


def candidate_builds(requested: str, report: HardwareReport, toolkits: Toolkits) -> list[tuple[str, str]]:
    """(build, why), best first. `auto` tries the best build for the hardware even where its toolkit
    is missing (a prebuilt wheel needs none), then the best one this machine can compile."""
    if requested != "auto":
        return [(requested, "requested")]
    best = recommend(report, Toolkits(nvcc=True, hipcc=True, vulkan_loader=True, glslc=True, xcode=True))
    compilable = recommend(report, toolkits)
    return list(dict.fromkeys([(best.build, best.reason), (compilable.build, compilable.reason)]))


def run_setup(args: argparse.Namespace, settings: Settings) -> int:
    console = Console(stderr=True)
    report = detect_hardware()
    toolkits = Toolkits.probe()
    sources = parse_sources([*args.wheels, *settings.llama_wheels])
    version = pinned_version()
    if version is None:
        raise SetupError(f"localserve's metadata names no pinned {PACKAGE} version; reinstall localserve")
    current = installed_build(report)
    candidates = candidate_builds(args.build, report, toolkits)
    if args.build == "auto" and not sources:
        candidates = candidates[-1:]  # nothing prebuilt to try: the compilable one
        for line in recommend(report, toolkits).missing:
            console.print(f"[yellow]note[/] {line}")
    elif args.build != "auto" and not sources and not toolkits.has(args.build):
        spec = BUILDS[args.build]  # before any work
        raise SetupError(f"the {args.build} build needs {spec.toolkit}, which is not installed: {spec.how_to_get}")
    log = settings.home / "logs" / f"setup-{candidates[0][0]}-{datetime.datetime.now():%Y%m%d-%H%M%S}.log"
    if args.dry_run:
        return _print_plan(candidates, sources, current, version, report)
    refusals: list[str] = []
    for build, why in candidates:
        if current == build and not args.force and installed_version() == version:
            console.print(f"{PACKAGE} {version} ({build} build) is already installed ({why}).")
            return 0
        with tempfile.TemporaryDirectory(prefix="localserve-setup-") as scratch:
            if _install_prebuilt(build, version, sources, Path(scratch), log, console, refusals):
                console.print(f"Installed the prebuilt {build} build of {PACKAGE} {version} ({why}); nothing was "
                              "compiled. Check it with `localserve hw`.")
                return 0
            if toolkits.has(build):
                _compile_and_install(build, why, version, report, current, Path(scratch), log, console)
                return 0
        spec = BUILDS[build]
        refusals.append(f"the {build} build needs {spec.toolkit} to compile, which is not installed: {spec.how_to_get}")
    raise SetupError("; ".join(refusals) + (f". Log: {log}" if log.exists() else ""))


def _install_prebuilt(build: str, version: str, sources: list[WheelSource], scratch: Path, log: Path,
                      console: Console, refusals: list[str]) -> bool:
    if not any(s.build in (None, build) for s in sources):
        return False
    log.parent.mkdir(parents=True, exist_ok=True)
    with console.status(f"looking for a prebuilt {build} build of {PACKAGE} {version}"):
        wheel, misses = find_wheel(build, version, sources, scratch, log)
    refusals.extend(misses)
    if wheel is None:
        return False
    if _run_logged(install_command(version, wheel.parent), dict(os.environ), log, console) != 0:
        raise SetupError(f"installing the prebuilt {build} wheel {wheel.name} failed; full log: {log}")
    return True


def _compile_and_install(build: str, why: str, version: str, report: HardwareReport, current: str | None,
                         scratch: Path, log: Path, console: Console) -> None:
    env = build_env(build, report)
    build_cmd, install_cmd = pip_commands(version, scratch)
    log.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"Building {PACKAGE} {version} for {build} ({why}); this compiles llama.cpp and takes "
                  f"minutes. Log: {log}")
    if _run_logged(build_cmd, env, log, console) != 0:
        raise SetupError(f"the {build} build of {PACKAGE} failed ({_last_error(log)}); the installed "
                         f"{current or 'no'} build is unchanged. Full log: {log}")
    if _run_logged(install_cmd, env, log, console) != 0:
        raise SetupError(f"installing the built {build} wheel failed; full log: {log}")
    console.print(f"Installed the {build} build of {PACKAGE} {version}. Check it with `localserve hw`.")


def _print_plan(candidates: list[tuple[str, str]], sources: list[WheelSource], current: str | None, version: str,
                report: HardwareReport) -> int:
    for build, why in candidates:
        print(f"build: {build} ({why}); installed: {current or 'none'}")
        for source in sources:
            if source.build in (None, build):
                print(f"prebuilt: {PACKAGE}=={version} from {source.location}")
        env = build_env(build, report)
        print(" ".join(f"{k}={shlex.quote(env[k])}" for k in ("CMAKE_ARGS", "CFLAGS", "CXXFLAGS", "FORCE_CMAKE") if env.get(k)))
        for cmd in pip_commands(version, Path("<scratch>")):
            print(shlex.join(cmd))
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
