"""The daemon's lifecycle seen from outside: one per LOCALSERVE_HOME, found through its run files.

Two files in `settings.run_dir`:
- `daemon.lock`: locked (fcntl/msvcrt) by the running daemon for its whole life. The OS drops the lock
  when the process dies, however it dies, so the lock -- not the pid file -- says whether a daemon
  runs. A daemon killed with SIGKILL or a power cut leaves its pid file behind; that stale file
  would otherwise make every later `run` talk to a dead port or `stop` signal a recycled pid.
- `daemon.json`: pid, URL and start time, written once the socket is bound (so it holds the real
  port even for `--port 0`) and removed on a clean exit.

The CLI reaches the daemon only over HTTP; this module just finds, starts and stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config.private import private_dir
from ..config.settings import Settings
from .daemon_crash import explain
from ..errors import DaemonError
from ..store.cache import FileLock, atomic_write_json

LOCK_NAME = "daemon.lock"
INFO_NAME = "daemon.json"
STDERR_NAME = "daemon-stderr.log"  # what a background daemon prints before its logging is set up
LOG_NAME = "localserve.log"  # the daemon's own log (server/main.py sets it up)


@dataclass
class DaemonInfo:
    pid: int
    url: str
    host: str
    port: int
    started_at: float


# --- the lock -------------------------------------------------------------------------------


def _lock_held(run_dir: Path) -> bool:
    """Whether some live process holds the daemon lock (probing takes it for an instant)."""
    path = run_dir / LOCK_NAME
    if not path.exists():
        return False
    probe = FileLock(path)
    if probe.acquire(blocking=False):
        probe.release()
        return False
    return True


class DaemonLock:
    """Held by `serve` from before binding the socket until after the last model is unloaded."""

    def __init__(self, settings: Settings):
        self.run_dir = settings.run_dir
        self._lock = FileLock(self.run_dir / LOCK_NAME)
        self._held = False

    def acquire(self) -> None:
        # Another CLI process may be probing the lock at this instant (`_lock_held`); a probe holds it
        # for microseconds, so retry briefly before concluding that a daemon runs.
        if not self._lock.acquire(poll=0.02, timeout=0.5):
            info = _read_info(self.run_dir)
            where = f" (pid {info.pid}, {info.url})" if info else ""
            raise DaemonError(f"a localserve daemon is already running for this home{where}")
        self._held = True
        # We hold the lock, so any pid file left here belongs to a daemon that died without cleanup.
        (self.run_dir / INFO_NAME).unlink(missing_ok=True)

    def publish(self, info: DaemonInfo) -> None:
        """Write the pid file atomically: a reader never sees half a JSON document."""
        atomic_write_json(self.run_dir / INFO_NAME, asdict(info))

    def release(self) -> None:
        if not self._held:
            return
        (self.run_dir / INFO_NAME).unlink(missing_ok=True)
        # The lock file itself stays: deleting it would let a process that opened the old inode and a
        # process that creates a new one both "hold" the lock.
        self._lock.release()
        self._held = False


def _read_info(run_dir: Path) -> DaemonInfo | None:
    try:
        data = json.loads((run_dir / INFO_NAME).read_text(encoding="utf-8"))
        return DaemonInfo(**data)
    except (OSError, ValueError, TypeError):
        return None


def find_daemon(settings: Settings) -> DaemonInfo | None:
    """The running daemon of this home, or None (no daemon, or only a stale pid file)."""
    if not _lock_held(settings.run_dir):
        return None
    return _read_info(settings.run_dir)


# --- health ----------------------------------------------------------------------------------


def check_health(url: str, timeout: float = 2.0) -> bool:
    from .client import DaemonClient

    return DaemonClient(url, timeout=timeout).healthy()


def wait_healthy(
    settings: Settings, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> DaemonInfo:
    """Poll until the daemon of this home has published its pid file and answers /health."""
    deadline = time.monotonic() + timeout
    while True:
        info = find_daemon(settings)
        if info is not None and check_health(info.url, timeout=2.0):
            return info
        if proc is not None and proc.poll() is not None:
            if _lock_held(settings.run_dir):
                # Ours lost a start race to another CLI process's daemon, which serves us too once
                # it is up. Only waiting for one that was already healthy failed a `run` whenever
                # the winner was still loading (seen in CI: two runs autostarting at once).
                proc = None
                continue
            if proc.returncode < 0:  # a signal: the fault record says more than its stderr
                raise DaemonError(explain(settings.log_dir, settings.log_dir / LOG_NAME, proc.pid, "starting", proc))
            raise DaemonError(f"the daemon exited while starting: {_last_error_line(settings)}")
        if time.monotonic() > deadline:
            raise DaemonError(f"the daemon did not become healthy within {timeout:.0f}s (see {settings.log_dir})")
        time.sleep(0.1)


def _last_error_line(settings: Settings) -> str:
    try:
        lines = (settings.log_dir / STDERR_NAME).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "no output"
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return "no output"


# --- start / stop ----------------------------------------------------------------------------


def serve_command(settings: Settings) -> list[str]:
    """argv of a background daemon with the same home/address as this CLI process; every other
    setting reaches it the same way it reached us (config file, LOCALSERVE_* environment)."""
    cmd = [sys.executable, "-m", "localserve", "serve", "--background", "--home", str(settings.home)]
    cmd += ["--host", settings.host, "--port", str(settings.port)]
    if settings.catalog:
        cmd += ["--catalog", str(settings.catalog)]
    if settings.sources.get("backend", "").startswith("flag"):  # `run --backend onnx` starting the daemon
        cmd += ["--backend", settings.backend]
    return cmd


def start_background(settings: Settings, timeout: float = 60.0) -> DaemonInfo:
    """Start `localserve serve` detached from this terminal and wait until it is healthy."""
    private_dir(settings.log_dir)
    kwargs: dict[str, Any] = {}
    if sys.platform == "win32":
        kwargs["creationflags"] = subprocess.DETACHED_PROCESS | subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined]
    else:
        # Own session: Ctrl-C in the terminal that ran `localserve run` must not reach the daemon.
        kwargs["start_new_session"] = True
    # 0600: what the daemon prints before its umask is set may quote a request (config/private.py).
    with os.fdopen(os.open(settings.log_dir / STDERR_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as err:
        proc = subprocess.Popen(
            serve_command(settings), stdin=subprocess.DEVNULL, stdout=err, stderr=err, close_fds=True, **kwargs
        )
    _started[proc.pid] = proc
    return wait_healthy(settings, timeout, proc)


# Daemons this process started: their exit status names a signal even when nothing else could
# record it (SIGKILL), and polling them reaps the zombie that would otherwise look alive.
_started: dict[int, subprocess.Popen[bytes]] = {}


def death_message(settings: Settings, info: DaemonInfo | None, doing: str) -> str | None:
    """One line saying how the daemon `info` died while this CLI was `doing` something, or None
    while it still lives (the error was something else)."""
    if info is None:
        return None
    proc = _started.get(info.pid)
    # The lock goes with the process's files as it exits (a zombie holds none), a moment after the
    # stream's socket closed: give it that moment before concluding the daemon lives.
    deadline = time.monotonic() + 1.0
    while _lock_held(settings.run_dir) and _pid_alive(info.pid) and (proc is None or proc.poll() is None):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return explain(settings.log_dir, settings.log_dir / LOG_NAME, info.pid, doing, proc)


def ensure_daemon(settings: Settings, timeout: float = 60.0) -> DaemonInfo:
    """The running daemon of this home, started in the background when there is none."""
    info = find_daemon(settings)
    if info is not None and check_health(info.url):
        return info
    if _lock_held(settings.run_dir):  # starting right now (another CLI process), or busy: wait for it
        return wait_healthy(settings, timeout)
    return start_background(settings, timeout)


def _pid_alive(pid: int) -> bool:
    if sys.platform == "win32":
        import psutil

        return psutil.pid_exists(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_daemon(settings: Settings, timeout: float = 30.0) -> DaemonInfo | None:
    """Ask the daemon of this home to shut down gracefully and wait until it is gone.

    Returns the stopped daemon's info, or None when none was running (a stale pid file is removed).
    The lock proves that the pid in the file is the live daemon's, not a recycled pid.
    """
    if not _lock_held(settings.run_dir):
        (settings.run_dir / INFO_NAME).unlink(missing_ok=True)  # stale: its daemon died without cleanup
        return None
    info = _read_info(settings.run_dir)
    if info is None:  # locked but not yet published: a daemon still binding its socket
        info = wait_healthy(settings, min(timeout, 30.0))
    if sys.platform == "win32":
        # Windows has no SIGTERM between processes and a detached daemon has no console to send
        # CTRL_BREAK to: this ends it without the graceful drain (unverified here, no Windows box).
        import psutil

        psutil.Process(info.pid).terminate()
    else:
        os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _lock_held(settings.run_dir) and _pid_alive(info.pid):
        if time.monotonic() > deadline:
            raise DaemonError(f"the daemon (pid {info.pid}) did not stop within {timeout:.0f}s")
        time.sleep(0.1)
    return info
