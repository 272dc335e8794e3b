"""A daemon that dies from a signal explains itself: its fault record, and the one line the CLI prints.

Why: a native fault in llama.cpp or ONNX Runtime (a GGML_ASSERT's abort(), a build whose AMX kernels
this CPU traps) ends the daemon at once. Its Python logging never runs, so the user saw only "the
daemon closed the stream before it finished", four minutes into README's first command, with no
clue where to look. Python's faulthandler writes the fatal signal and every thread's stack from
inside the signal handler, so the daemon turns it on into `daemon-crash.log` in its log directory
(one section per daemon start). The CLI, when the daemon it talks to vanishes, reads that section
and says in one line: the signal, what the crashing thread was doing, the log file, and the fix
where one is known. SIGKILL (the out-of-memory killer) leaves no record; a CLI that started the
daemon still learns the signal from the child's exit status.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CRASH_NAME = "daemon-crash.log"
_KEEP_BYTES = 256 * 1024  # older sections are trimmed at start: one stack dump is a few KiB
_HEADER = re.compile(r"^--- localserve daemon pid (\d+) started")
# faulthandler's words for each fatal signal (Python/faulthandler.c's handler table).
_FAULT_NAMES = {
    "Segmentation fault": "SIGSEGV", "Illegal instruction": "SIGILL", "Aborted": "SIGABRT",
    "Bus error": "SIGBUS", "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE",
}
# The innermost frame of ours in the crashing thread -> what the daemon was doing.
_ACTIVITIES = (
    ("llamacpp_probe", "probing llama.cpp"), ("load", "loading a model"), ("decode", "decoding"),
    ("embed", "computing embeddings"), ("sample", "sampling"), ("convert", "converting a model"),
    ("tokenize", "tokenizing"),
)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line \d+ in (?P<func>\S+)')
_record: IO[str] | None = None  # faulthandler keeps only the fd: the file object must stay open


def enable_fault_record(log_dir: Path) -> Path:
    """In the daemon: faulthandler into this start's section of the crash log."""
    global _record
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / CRASH_NAME
    _trim(path)
    _record = open(path, "a", encoding="utf-8")
    _record.write(f"--- localserve daemon pid {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    _record.flush()
    faulthandler.enable(file=_record, all_threads=True)
    return path


def _trim(path: Path) -> None:
    try:
        if path.stat().st_size <= 4 * _KEEP_BYTES:
            return
        with open(path, "rb") as f:
            f.seek(-_KEEP_BYTES, os.SEEK_END)
            tail = f.read()
    except OSError:
        return
    start = tail.find(b"\n--- localserve daemon pid ")
    path.write_bytes(tail[start + 1:] if start >= 0 else b"")


@dataclass(frozen=True)
class Death:
    pid: int
    signal: str | None  # "SIGSEGV"; None when nothing says which
    activity: str | None  # "decoding", "loading a model"; None when no stack was recorded


def read_death(log_dir: Path, pid: int) -> Death | None:
    """What the crash log says about daemon `pid`: None when its section records no fault."""
    try:
        lines = (log_dir / CRASH_NAME).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    section: list[str] | None = None
    for line in lines:
        header = _HEADER.match(line)
        if header:
            section = [] if int(header.group(1)) == pid else None
        elif section is not None:
            section.append(line)
    if not section:
        return None
    fault = next((line for line in section if line.startswith("Fatal Python error: ")), None)
    if fault is None:
        return None
    words = fault[len("Fatal Python error: "):].strip()
    return Death(pid, _FAULT_NAMES.get(words, words or None), _activity(section))


def _activity(section: list[str]) -> str | None:
    """From the crashing thread's stack ("Current thread ... (most recent call first)")."""
    current = next((i for i, line in enumerate(section) if line.startswith("Current thread")), None)
    if current is None:
        return None
    for line in section[current + 1:]:
        frame = _FRAME.match(line)
        if frame is None:
            break
        if f"{os.sep}localserve{os.sep}" not in frame.group("file"):
            continue
        where = f"{Path(frame.group('file')).stem}.{frame.group('func')}"
        for word, activity in _ACTIVITIES:
            if word in where:
                return activity
    return None


def _signal_of(proc: subprocess.Popen[bytes] | None) -> str | None:
    code = proc.poll() if proc is not None else None
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _fix(sig: str | None) -> str:
    if sig in ("SIGILL", "SIGSEGV", "SIGBUS"):
        from ..backends.llamacpp.probe import needs_probe
        from ..runtime.planning import hardware_report

        try:
            amx = needs_probe(hardware_report().cpu.features)
        except Exception:  # noqa: BLE001 - no llama_cpp here: no AMX advice either
            amx = False
        if amx:
            return "; this CPU claims AMX and llama.cpp was built with it: `localserve setup` builds it without"
    if sig == "SIGKILL":
        return "; SIGKILL is what the out-of-memory killer sends: try a smaller model or context"
    return ""


def explain(log_dir: Path, log_file: Path, pid: int, doing: str,
            proc: subprocess.Popen[bytes] | None = None) -> str:
    """One line for a daemon that died while the CLI was `doing` something ("generating with X")."""
    death = read_death(log_dir, pid)
    sig = (death.signal if death else None) or _signal_of(proc)
    activity = death.activity if death and death.activity else None
    what = f"died from {sig}" if sig else "died without a word (no fault record: SIGKILL or a power cut?)"
    during = f"while {activity} ({doing})" if activity else f"while {doing}"
    stack = f"; native fault record: {log_dir / CRASH_NAME}" if death else ""
    return f"the daemon (pid {pid}) {what} {during}; its log: {log_file}{stack}{_fix(sig)}"


def last_death(log_dir: Path) -> Death | None:
    """The most recent daemon's death, if it died from a signal (for `serve` and the tray)."""
    try:
        text = (log_dir / CRASH_NAME).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    pids = [int(m.group(1)) for line in text.splitlines() if (m := _HEADER.match(line))]
    return read_death(log_dir, pids[-1]) if pids else None
