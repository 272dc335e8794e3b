"""What the tray's menu items do. Every daemon call goes over HTTP through DaemonClient; the
clipboard goes through the platform's own tool, since pystray has no clipboard."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import webbrowser
from typing import Callable

from ..desktop import autostart
from ..desktop.client import DaemonClient
from ..config.settings import Settings
from ..desktop.daemon import LOG_NAME, ensure_daemon, find_daemon, stop_daemon
from ..errors import DaemonError
from .state import DaemonState

LOAD_TIMEOUT_S = 600.0  # loading a large model from a slow disk takes minutes


def clipboard_command(platform: str | None = None, environ: dict[str, str] | None = None) -> list[str]:
    """argv of a program that puts its stdin on the clipboard."""
    platform, environ = platform or sys.platform, os.environ if environ is None else environ
    if platform == "win32":
        return ["clip"]
    if platform == "darwin":
        return ["pbcopy"]
    candidates = [["xclip", "-selection", "clipboard"], ["xsel", "--clipboard", "--input"]]
    if environ.get("WAYLAND_DISPLAY"):
        candidates.insert(0, ["wl-copy"])
    for argv in candidates:
        if shutil.which(argv[0]):
            return argv
    raise DaemonError("no clipboard tool found: install xclip, xsel or wl-clipboard")


def copy_text(text: str) -> None:
    argv = clipboard_command()
    # clip.exe reads the console code page; UTF-16 with a BOM is what it takes for any text.
    data = ("\ufeff" + text).encode("utf-16-le") if argv == ["clip"] else text.encode("utf-8")
    # xclip stays behind to own the selection: its output must not hold our pipes open.
    subprocess.run(argv, input=data, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=10)


def open_path(path: str) -> None:
    """Open a file with the desktop's default application."""
    if sys.platform == "win32":
        os.startfile(path)  # type: ignore[attr-defined]
    else:
        subprocess.Popen(["open" if sys.platform == "darwin" else "xdg-open", path],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class TrayActions:
    def __init__(self, settings: Settings, quit_tray: Callable[[], None],
                 open_url: Callable[[str], object] = webbrowser.open):
        self.settings = settings
        self.quit_tray = quit_tray
        self.open_url = open_url

    def client(self, timeout: float = 10.0) -> DaemonClient | None:
        info = find_daemon(self.settings)
        return None if info is None else DaemonClient(info.url, api_key=self.settings.api_key, timeout=timeout)

    def _daemon(self, timeout: float = 10.0) -> DaemonClient:
        client = self.client(timeout)
        if client is None:
            raise DaemonError("localserve is not running")
        return client

    def run(self, action: str, arg: str | None, state: DaemonState) -> None:
        getattr(self, action)(arg, state)

    # --- the items -----------------------------------------------------------------------------
    def open(self, path: str | None, state: DaemonState) -> None:
        self.open_url(state.url + (path or "/"))

    def toggle_model(self, name: str | None, state: DaemonState) -> None:
        assert name is not None
        # Ollama's way: a request without a prompt loads; keep_alive 0 unloads.
        body = {"model": name, "keep_alive": 0} if name in state.loaded else {"model": name}
        self._daemon(LOAD_TIMEOUT_S).request_json("POST", "/api/generate", body)

    def unload_all(self, _: str | None, state: DaemonState) -> None:
        client = self._daemon()
        for name in state.loaded:
            client.request_json("POST", "/api/generate", {"model": name, "keep_alive": 0})

    def copy_endpoint(self, _: str | None, state: DaemonState) -> None:
        copy_text(state.url + "/v1")  # the base URL OpenAI clients take

    def copy_key(self, _: str | None, state: DaemonState) -> None:
        if self.settings.api_key:
            copy_text(self.settings.api_key)

    def toggle_autostart(self, _: str | None, state: DaemonState) -> None:
        if autostart.status().enabled:
            autostart.disable()
        else:
            autostart.enable()

    def show_logs(self, _: str | None, state: DaemonState) -> None:
        open_path(str(self.settings.log_dir / LOG_NAME))

    def start_server(self, _: str | None, state: DaemonState) -> None:
        ensure_daemon(self.settings)

    def stop_server(self, _: str | None, state: DaemonState) -> None:
        stop_daemon(self.settings)

    def quit(self, _: str | None, state: DaemonState) -> None:
        self.quit_tray()

    def quit_and_stop(self, _: str | None, state: DaemonState) -> None:
        stop_daemon(self.settings)
        self.quit_tray()
