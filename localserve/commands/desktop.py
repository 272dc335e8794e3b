"""`tray` and `autostart`: localserve as a desktop app that people leave running."""

from __future__ import annotations

import argparse

from ..desktop import autostart
from ..config.settings import Settings
from ..desktop.daemon import find_daemon


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("tray", parents=[common], help="the tray icon (starts the daemon when needed)")
    p.set_defaults(func=cmd_tray)

    p = subparsers.add_parser("autostart", parents=[common], help="start the tray at login: on, off or status")
    p.add_argument("action", choices=("on", "off", "status"))
    p.set_defaults(func=cmd_autostart)


def cmd_tray(args: argparse.Namespace, settings: Settings) -> int:
    # Imported here: pystray and Pillow are the `tray` extra, not needed by any other command.
    from ..tray.app import run_tray

    return run_tray(settings)


def cmd_autostart(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "on":
        state = autostart.enable()
    elif args.action == "off":
        state = autostart.disable()
    else:
        state = autostart.status()
    print(f"Start at login: {'on' if state.enabled else 'off'} ({state.location})")
    return 0


def dashboard_hint(settings: Settings) -> str:
    """What `localserve` alone prints: where the dashboard is, and whether it is up."""
    info = find_daemon(settings)
    url = (info.url if info is not None else settings.base_url) + "/"
    if info is not None:
        return f"Dashboard: {url}\nRun `localserve --help` for the commands."
    return (f"Dashboard: {url} (the daemon is not running: `localserve serve` or `localserve tray` starts it)\n"
            "Run `localserve --help` for the commands.")
