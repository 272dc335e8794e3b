"""Start at login: one per-user entry that runs `localserve tray`, on each desktop OS.

- Linux/BSD: an XDG autostart entry, `$XDG_CONFIG_HOME/autostart/localserve.desktop` (every
  freedesktop session — GNOME, KDE, Xfce — runs these at login).
- macOS: a LaunchAgent, `~/Library/LaunchAgents/<LAUNCH_AGENT_LABEL>.plist`, RunAtLoad.
- Windows: a value under `HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run`.

Every function takes its roots (`home`, `environ`, `run_key`) as arguments so the three layouts can
be checked on any machine against recorded entries; the defaults are the real ones. The installer
(`localserve autostart on`) and the tray's "Start at login" item both go through here.
"""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from .plain_values import check_plain

APP_ID = "localserve"
LAUNCH_AGENT_LABEL = "io.localserve.tray"
RUN_KEY_PATH = r"Software\Microsoft\Windows\CurrentVersion\Run"
# Characters the Desktop Entry spec reserves in an Exec argument (which must then be quoted).
_EXEC_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


@dataclass(frozen=True)
class AutostartState:
    enabled: bool
    location: str  # the file, or the registry value, that holds (or would hold) the entry
    command: tuple[str, ...] = ()  # what it launches, when enabled


class RunKey(Protocol):
    """The HKCU Run key: string values by name."""

    def get(self, name: str) -> str | None: ...
    def set(self, name: str, value: str) -> None: ...
    def delete(self, name: str) -> None: ...


class WinRegRunKey:
    """The real Run key, through winreg (Windows only)."""

    def get(self, name: str) -> str | None:
        import winreg  # type: ignore[import-not-found]

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY_PATH) as key:
                return str(winreg.QueryValueEx(key, name)[0])
        except FileNotFoundError:
            return None

    def set(self, name: str, value: str) -> None:
        import winreg  # type: ignore[import-not-found]

        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, RUN_KEY_PATH) as key:
            winreg.SetValueEx(key, name, 0, winreg.REG_SZ, value)

    def delete(self, name: str) -> None:
        import winreg  # type: ignore[import-not-found]

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY_PATH, 0, winreg.KEY_SET_VALUE) as key:
                winreg.DeleteValue(key, name)
        except FileNotFoundError:
            pass


def tray_command(python: str | None = None, platform: str | None = None) -> list[str]:
    """argv that starts the tray with this interpreter. On Windows pythonw.exe (same directory) is
    used when present, so no console window opens at login."""
    python = python or sys.executable
    if (platform or sys.platform) == "win32":
        gui = Path(python).with_name("pythonw.exe")
        if gui.exists():
            python = str(gui)
    return [python, "-m", "localserve", "tray"]


# --- XDG ---------------------------------------------------------------------------------------


def desktop_file(home: Path, environ: Mapping[str, str]) -> Path:
    config = environ.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Path(config) / "autostart" / f"{APP_ID}.desktop"


def _exec_arg(arg: str) -> str:
    """One Exec argument per the Desktop Entry spec: quoted when it holds reserved characters,
    with `"`, `` ` ``, `$` and `\\` backslash-escaped inside the quotes; `%` doubled (field codes)."""
    arg = arg.replace("%", "%%")
    if arg and not (set(arg) & _EXEC_RESERVED):
        return arg
    inner = "".join("\\" + c if c in '"`$\\' else c for c in arg)
    return f'"{inner}"'


def _check_command(command: Sequence[str], target: str) -> None:
    check_plain([("the interpreter's path" if i == 0 else f"argument {i} of the tray command", arg)
                 for i, arg in enumerate(command)], target)


def desktop_entry(command: Sequence[str]) -> str:
    _check_command(command, "the autostart entry")
    # The value of a desktop-file key is itself escaped: each backslash of the Exec line doubles.
    exec_line = " ".join(_exec_arg(a) for a in command).replace("\\", "\\\\")
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=localserve\n"
        "Comment=Local LLM server (tray icon)\n"
        f"Exec={exec_line}\n"
        "Terminal=false\n"
        "X-GNOME-Autostart-enabled=true\n"
    )


def _parse_exec(text: str) -> tuple[str, ...]:
    for line in text.splitlines():
        if line.startswith("Exec="):
            value = line[len("Exec="):]
            args, cur, quoted, i, started = [], [], False, 0, False
            value = value.replace("\\\\", "\\")
            while i < len(value):
                c = value[i]
                if quoted and c == "\\" and i + 1 < len(value):
                    cur.append(value[i + 1])
                    i += 1
                elif c == '"':
                    quoted, started = not quoted, True
                elif c == " " and not quoted:
                    if cur or started:
                        args.append("".join(cur))
                    cur, started = [], False
                else:
                    cur.append(c)
                i += 1
            if cur or started:
                args.append("".join(cur))
            return tuple(a.replace("%%", "%") for a in args)
    return ()


# --- macOS -------------------------------------------------------------------------------------


def launch_agent_file(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"


def launch_agent(command: Sequence[str]) -> bytes:
    _check_command(command, "the LaunchAgent")
    return plistlib.dumps({
        "Label": LAUNCH_AGENT_LABEL,
        "ProgramArguments": list(command),
        "RunAtLoad": True,
        # Interactive: launchd must not throttle a process the user sees (the menu-bar icon).
        "ProcessType": "Interactive",
    })


# --- the three, by platform --------------------------------------------------------------------


def _kind(platform: str) -> str:
    if platform == "win32":
        return "windows"
    if platform == "darwin":
        return "macos"
    return "xdg"


def enable(command: Sequence[str] | None = None, *, platform: str | None = None, home: Path | None = None,
           environ: Mapping[str, str] | None = None, run_key: RunKey | None = None) -> AutostartState:
    """Write the entry (replacing an older one) and return the new state."""
    platform, home, environ = platform or sys.platform, home or Path.home(), os.environ if environ is None else environ
    command = list(command or tray_command(platform=platform))
    kind = _kind(platform)
    if kind == "windows":
        _check_command(command, "the Run key")
        (run_key or WinRegRunKey()).set(APP_ID, subprocess.list2cmdline(command))
    else:
        path = desktop_file(home, environ) if kind == "xdg" else launch_agent_file(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = desktop_entry(command).encode("utf-8") if kind == "xdg" else launch_agent(command)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # never a half-written entry for the session to trip on
    return status(platform=platform, home=home, environ=environ, run_key=run_key)


def disable(*, platform: str | None = None, home: Path | None = None, environ: Mapping[str, str] | None = None,
            run_key: RunKey | None = None) -> AutostartState:
    platform, home, environ = platform or sys.platform, home or Path.home(), os.environ if environ is None else environ
    kind = _kind(platform)
    if kind == "windows":
        (run_key or WinRegRunKey()).delete(APP_ID)
    else:
        path = desktop_file(home, environ) if kind == "xdg" else launch_agent_file(home)
        path.unlink(missing_ok=True)
    return status(platform=platform, home=home, environ=environ, run_key=run_key)


def status(*, platform: str | None = None, home: Path | None = None, environ: Mapping[str, str] | None = None,
           run_key: RunKey | None = None) -> AutostartState:
    platform, home, environ = platform or sys.platform, home or Path.home(), os.environ if environ is None else environ
    kind = _kind(platform)
    if kind == "windows":
        value = (run_key or WinRegRunKey()).get(APP_ID)
        location = f"HKCU\\{RUN_KEY_PATH}\\{APP_ID}"
        return AutostartState(value is not None, location, tuple(_split_windows(value)) if value else ())
    path = desktop_file(home, environ) if kind == "xdg" else launch_agent_file(home)
    try:
        data = path.read_bytes()
    except OSError:
        return AutostartState(False, str(path))
    if kind == "xdg":
        return AutostartState(True, str(path), _parse_exec(data.decode("utf-8", "replace")))
    try:
        args = plistlib.loads(data).get("ProgramArguments") or []
    except Exception:  # a damaged plist still occupies the slot: enabled, command unknown
        args = []
    return AutostartState(True, str(path), tuple(str(a) for a in args))


def _split_windows(value: str) -> list[str]:
    """Inverse of subprocess.list2cmdline for the command lines it produces."""
    args, cur, quoted, backslashes, started = [], [], False, 0, False
    for c in value:
        if c == "\\":
            backslashes += 1
            continue
        if c == '"':
            cur.append("\\" * (backslashes // 2))
            if backslashes % 2:
                cur.append('"')
            else:
                quoted, started = not quoted, True
            backslashes = 0
            continue
        cur.append("\\" * backslashes)
        backslashes = 0
        if c in " \t" and not quoted:
            if "".join(cur) or started:
                args.append("".join(cur))
            cur, started = [], False
        else:
            cur.append(c)
    cur.append("\\" * backslashes)
    if "".join(cur) or started:
        args.append("".join(cur))
    return args
