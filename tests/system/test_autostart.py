"""Start-at-login entries on the three desktop OSes, written under temporary roots.

XDG and macOS write real files (read back with the parsers their sessions use: the Desktop Entry
quoting rules, plistlib); the Windows Run key is a dict-backed RunKey, checked against the command
line CreateProcess would split (recorded below), since winreg exists only on Windows.
"""

from __future__ import annotations

import plistlib
import subprocess

import pytest

from localserve.desktop import autostart

from daemon_util import cli, cli_env, free_port

TRICKY = ["/opt/my apps/py$thon\\3", "-m", "localserve", "tray", "--home", 'a "quoted" 100%']


class DictRunKey:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def get(self, name: str) -> str | None:
        return self.values.get(name)

    def set(self, name: str, value: str) -> None:
        self.values[name] = value

    def delete(self, name: str) -> None:
        self.values.pop(name, None)


def test_xdg_entry_round_trips_and_honours_xdg_config_home(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    assert not autostart.status(platform="linux", home=tmp_path, environ=env).enabled
    state = autostart.enable(TRICKY, platform="linux", home=tmp_path, environ=env)
    path = tmp_path / "cfg" / "autostart" / "localserve.desktop"
    assert state.enabled and state.location == str(path) and state.command == tuple(TRICKY)
    text = path.read_text()
    assert "[Desktop Entry]" in text and "Type=Application" in text
    # A string value unescapes \\ to \ first; the spec's quoting of the Exec line is then the
    # POSIX shell's double-quote rule, so sh itself splits it (an independent parser).
    exec_line = next(l for l in text.splitlines() if l.startswith("Exec="))[5:].replace("\\\\", "\\")
    split = subprocess.run(["sh", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "sh", exec_line],
                           capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert [a.replace("%%", "%") for a in split] == TRICKY
    assert not autostart.disable(platform="linux", home=tmp_path, environ=env).enabled
    assert not path.exists()
    autostart.disable(platform="linux", home=tmp_path, environ=env)  # twice: no error


def test_xdg_default_dir_is_dot_config(tmp_path):
    state = autostart.enable(["/usr/bin/python3", "-m", "localserve", "tray"], platform="linux",
                             home=tmp_path, environ={})
    assert state.location == str(tmp_path / ".config" / "autostart" / "localserve.desktop")
    assert "Exec=/usr/bin/python3 -m localserve tray\n" in (tmp_path / ".config/autostart/localserve.desktop").read_text()


def test_macos_launch_agent(tmp_path):
    state = autostart.enable(TRICKY, platform="darwin", home=tmp_path, environ={})
    path = tmp_path / "Library" / "LaunchAgents" / f"{autostart.LAUNCH_AGENT_LABEL}.plist"
    assert state.enabled and state.location == str(path)
    plist = plistlib.loads(path.read_bytes())
    assert plist["ProgramArguments"] == TRICKY and plist["RunAtLoad"] is True
    assert plist["Label"] == autostart.LAUNCH_AGENT_LABEL
    assert not autostart.disable(platform="darwin", home=tmp_path, environ={}).enabled and not path.exists()


def test_windows_run_key():
    key = DictRunKey()
    argv = [r"C:\Program Files\Python312\pythonw.exe", "-m", "localserve", "tray"]
    state = autostart.enable(argv, platform="win32", run_key=key)
    # Recorded: what the Run key of a Python under Program Files must hold for Explorer to split it.
    assert key.values == {"localserve": r'"C:\Program Files\Python312\pythonw.exe" -m localserve tray'}
    assert state.enabled and state.command == tuple(argv)
    assert state.location == r"HKCU\Software\Microsoft\Windows\CurrentVersion\Run\localserve"
    tricky = [r"C:\a b\x.exe", 'say "hi"', "trailing\\", ""]
    autostart.enable(tricky, platform="win32", run_key=key)
    assert autostart.status(platform="win32", run_key=key).command == tuple(tricky)
    assert key.values["localserve"] == subprocess.list2cmdline(tricky)
    assert not autostart.disable(platform="win32", run_key=key).enabled and key.values == {}


def test_windows_prefers_pythonw(tmp_path):
    (tmp_path / "python.exe").write_bytes(b"")
    assert autostart.tray_command(str(tmp_path / "python.exe"), "win32")[0] == str(tmp_path / "python.exe")
    (tmp_path / "pythonw.exe").write_bytes(b"")
    assert autostart.tray_command(str(tmp_path / "python.exe"), "win32") == [
        str(tmp_path / "pythonw.exe"), "-m", "localserve", "tray"]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="the CLI writes this OS's entry")
def test_cli_autostart_on_off_status(tmp_path):
    env = cli_env(tmp_path / "home", free_port(), HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    path = tmp_path / "xdg" / "autostart" / "localserve.desktop"
    assert "off" in cli(env, "autostart", "status").stdout
    on = cli(env, "autostart", "on")
    assert on.returncode == 0 and "on" in on.stdout and str(path) in on.stdout
    assert autostart.status(platform="linux", home=tmp_path, environ={"XDG_CONFIG_HOME": str(tmp_path / "xdg")}).command[-3:] == (
        "-m", "localserve", "tray")
    assert "Start at login: on" in cli(env, "autostart", "status").stdout
    assert cli(env, "autostart", "off").returncode == 0 and not path.exists()


def test_bare_localserve_prints_the_dashboard(tmp_path):
    port = free_port()
    result = cli(cli_env(tmp_path, port))
    assert result.returncode == 0
    assert f"Dashboard: http://127.0.0.1:{port}/" in result.stdout and "--help" in result.stdout
    assert "autostart" in cli(cli_env(tmp_path, port), "--help").stdout


# --- values that would add lines (review 3 A.11) ---------------------------------------------------
from pathlib import Path  # noqa: E402

from localserve.errors import ConfigError  # noqa: E402
from localserve.desktop.service import ServiceSpec, systemd_unit  # noqa: E402

INJECTED = "/home/u\nExecStartPre=/bin/sh -c 'touch /tmp/pwned'"


@pytest.mark.parametrize("bad", ["\n", "\r", "\t", "\0", "\x1b", "\x85", "\u2028"])
def test_unit_and_launch_agent_values_with_control_characters_are_refused(bad):
    for spec in (lambda: ServiceSpec(Path(f"/opt/ls{bad}bin/localserve"), 11480),
                 lambda: ServiceSpec(Path("/opt/localserve"), 11480, home=Path(f"/data{bad}x")),
                 lambda: ServiceSpec(Path("/opt/localserve"), 11480, log_dir=Path(f"/logs{bad}x"))):
        with pytest.raises(ConfigError, match="holds a control character .* into the service definition"):
            spec()


def test_a_home_with_a_newline_never_reaches_the_unit_text():
    with pytest.raises(ConfigError, match=r"LOCALSERVE_HOME holds a control character \('\\n' at position 7\)") as refused:
        systemd_unit(ServiceSpec(Path("/opt/localserve"), 11480, home=Path(INJECTED)))
    assert "ExecStartPre" not in str(refused.value) and "/home/u" not in str(refused.value)  # the role, not the path
    ok = systemd_unit(ServiceSpec(Path("/opt/my apps/localserve"), 11480, home=Path("/data/a b")))
    assert "Environment=\"LOCALSERVE_HOME=/data/a b\"" in ok


@pytest.mark.parametrize("platform", ["linux", "darwin", "win32"])
def test_autostart_entries_with_control_characters_are_refused_and_nothing_is_written(tmp_path, platform):
    run_key = DictRunKey()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for command in ([f"/opt/py\nExec=/bin/evil", "-m", "localserve", "tray"], ["/usr/bin/python3", "-m", "tray\r"]):
        with pytest.raises(ConfigError, match="holds a control character"):
            autostart.enable(command, platform=platform, home=tmp_path, environ=env, run_key=run_key)
    assert run_key.values == {} and not any(tmp_path.rglob("*.desktop")) and not any(tmp_path.rglob("*.plist"))
    with pytest.raises(ConfigError, match="the interpreter's path holds a control character"):
        autostart.desktop_entry(["/opt/py\nExec=/bin/evil", "-m", "localserve", "tray"])
    with pytest.raises(ConfigError, match="argument 2 of the tray command"):
        autostart.launch_agent(["/usr/bin/python3", "-m", "local\x00serve"])
