"""The daemon as a per-user service: a systemd user unit on Linux, a LaunchAgent on macOS.

Pure functions produce the unit / plist text (tested offline, verified with `systemd-analyze
verify` and plistlib); `install` / `uninstall` write and remove them and ask the service manager
to (re)start or stop the daemon when one is running for this user. The tray's login item is not
here: `localserve autostart` owns it.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from .plain_values import check_plain

UNIT_NAME = "localserve.service"
AGENT_LABEL = "io.localserve.daemon"


@dataclass(frozen=True)
class ServiceSpec:
    exe: Path  # the `localserve` console script to run
    port: int
    home: Path | None = None  # LOCALSERVE_HOME for the daemon, when the installer set one
    log_dir: Path | None = None  # macOS: where launchd sends the daemon's stdout/stderr

    def __post_init__(self) -> None:
        # Checked here, once for both renderers: a spec that could add lines to a unit never exists.
        check_plain([("the localserve program's path", str(self.exe)),
                     ("LOCALSERVE_HOME", str(self.home or "")), ("the log directory", str(self.log_dir or ""))],
                    "the service definition")

    def argv(self) -> list[str]:
        return [str(self.exe), "serve", "--port", str(self.port)]


def _systemd_quote(arg: str) -> str:
    # systemd expands %specifiers and $VARIABLES in ExecStart/Environment: double both so a path
    # containing them is taken literally, and quote so spaces do not split the argument.
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def systemd_unit(spec: ServiceSpec) -> str:
    env = f"Environment={_systemd_quote(f'LOCALSERVE_HOME={spec.home}')}\n" if spec.home else ""
    return (
        "[Unit]\n"
        "Description=localserve: local LLM server (OpenAI- and Ollama-compatible API)\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={' '.join(_systemd_quote(a) for a in spec.argv())}\n"
        f"{env}"
        # The daemon finishes in-flight requests on SIGTERM within shutdown_timeout (10 s default).
        "TimeoutStopSec=30\n"
        "Restart=on-failure\n"
        "RestartSec=3\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def launch_agent(spec: ServiceSpec) -> bytes:
    plist: dict[str, object] = {
        "Label": AGENT_LABEL,
        "ProgramArguments": spec.argv(),
        "RunAtLoad": True,
        # Restart after a crash, not after `localserve stop` (a clean exit).
        "KeepAlive": {"SuccessfulExit": False},
        "ProcessType": "Interactive",
    }
    if spec.home:
        plist["EnvironmentVariables"] = {"LOCALSERVE_HOME": str(spec.home)}
    if spec.log_dir:
        plist["StandardOutPath"] = str(spec.log_dir / "daemon.log")
        plist["StandardErrorPath"] = str(spec.log_dir / "daemon.log")
    return plistlib.dumps(plist)


def service_path(system: str = sys.platform, home: Path | None = None, environ: dict[str, str] | None = None) -> Path:
    environ = dict(os.environ) if environ is None else environ
    home = home or Path.home()
    if system == "darwin":
        return home / "Library" / "LaunchAgents" / f"{AGENT_LABEL}.plist"
    config = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
    return config / "systemd" / "user" / UNIT_NAME


def render(spec: ServiceSpec, system: str = sys.platform) -> bytes:
    return launch_agent(spec) if system == "darwin" else systemd_unit(spec).encode()


def port_holder(port: int) -> str | None:
    """Who listens on `port` on this machine ("python3 (pid 812)"), or None when it is free.

    Listing other users' sockets needs privileges on some systems: a listener we may not name is
    still reported, as "another program"."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, PermissionError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                return "another program"
            try:
                return f"{psutil.Process(c.pid).name()} (pid {c.pid})"
            except psutil.Error:
                return f"pid {c.pid}"
    import socket  # noqa: PLC0415 - fallback when the listing was not allowed

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return "another program"
    return None


def manager_available(system: str = sys.platform) -> bool:
    """Whether a per-user service manager answers here (containers and SSH sessions often lack one)."""
    if system == "darwin":
        return shutil.which("launchctl") is not None
    if shutil.which("systemctl") is None:
        return False
    done = subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True, text=True, timeout=10)
    return done.stdout.strip() in {"running", "degraded", "starting"}


def manager_commands(action: str, path: Path, system: str = sys.platform) -> list[list[str]]:
    """What to ask the service manager for `action` ("start" after writing, "stop" before removing)."""
    if system == "darwin":
        uid = os.getuid() if hasattr(os, "getuid") else 0
        target = f"gui/{uid}"
        if action == "start":
            return [["launchctl", "bootout", f"{target}/{AGENT_LABEL}"], ["launchctl", "bootstrap", target, str(path)]]
        return [["launchctl", "bootout", f"{target}/{AGENT_LABEL}"]]
    if action == "start":
        return [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", UNIT_NAME],
                ["systemctl", "--user", "restart", UNIT_NAME]]
    return [["systemctl", "--user", "disable", "--now", UNIT_NAME], ["systemctl", "--user", "daemon-reload"]]
