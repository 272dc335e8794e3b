"""`localserve service install|uninstall|status`: the daemon as a per-user service (see service.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ..config.settings import Settings
from ..desktop.daemon import find_daemon, stop_daemon
from ..errors import LocalserveError
from ..desktop.service import ServiceSpec, manager_available, manager_commands, port_holder, render, service_path


class ServiceError(LocalserveError):
    code = "service_error"


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("service", parents=[common], help="run the daemon as a user service (systemd / launchd)")
    p.add_argument("action", choices=["install", "uninstall", "status"])
    p.add_argument("--no-start", action="store_true", help="install: write the service file, start nothing")
    p.set_defaults(func=run_service)


def _spec(settings: Settings) -> ServiceSpec:
    # The console script beside this interpreter: the installer's isolated environment, never
    # whatever `localserve` happens to come first on PATH.
    exe = Path(sys.executable).parent / ("localserve.exe" if sys.platform == "win32" else "localserve")
    home = settings.home if settings.home != Settings().home else None
    return ServiceSpec(exe=exe, port=settings.port, home=home, log_dir=settings.log_dir)


def _ask_manager(action: str, path: Path) -> list[str]:
    """Run the service manager's commands; returns the failures (one line each), never raises."""
    failures = []
    for cmd in manager_commands(action, path):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        # launchctl bootout of an agent that is not loaded fails harmlessly before a bootstrap.
        if done.returncode != 0 and cmd[1] != "bootout":
            failures.append(f"{' '.join(cmd)}: {(done.stderr or done.stdout).strip().splitlines()[-1:] or ['failed']}")
    return failures


def run_service(args: argparse.Namespace, settings: Settings) -> int:
    path = service_path()
    if sys.platform == "win32":
        raise ServiceError("on Windows the daemon starts with the tray (`localserve autostart on`), not as a service")
    if args.action == "status":
        print(f"service file: {path if path.exists() else 'not installed'}")
        daemon = find_daemon(settings)
        print(f"daemon: {'running at ' + daemon.url + f' (pid {daemon.pid})' if daemon else 'not running'}")
        return 0 if path.exists() else 3
    if args.action == "uninstall":
        if path.exists() and manager_available():
            _ask_manager("stop", path)
        path.unlink(missing_ok=True)
        (path.parent / "default.target.wants" / path.name).unlink(missing_ok=True)
        stop_daemon(settings)
        print(f"removed {path}")
        return 0
    # install: an upgrade replaces our own daemon; anything else on the port is the user's to move.
    stop_daemon(settings)
    holder = port_holder(settings.port)
    if holder is not None:
        raise ServiceError(f"port {settings.port} is in use by {holder}; choose another port with --port")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(render(_spec(settings)))
    print(f"wrote {path}")
    if args.no_start:
        return 0
    if not manager_available():
        if sys.platform != "darwin":
            # What `systemctl --user enable` would do: systemd reads the link at the next login.
            link = path.parent / "default.target.wants" / path.name
            link.parent.mkdir(exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(path)
        print("no user service manager answers in this session: the service starts at your next login")
        return 0
    failures = _ask_manager("start", path)
    if failures:
        raise ServiceError("the service manager refused the service: " + "; ".join(failures))
    print(f"the daemon runs as a service on port {settings.port}")
    return 0
