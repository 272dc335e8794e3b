"""installer/windows/localserve.nsi compiles with makensis (Debian's nsis) into an installer whose
file list has every file the script names. Running it needs Windows: not done here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "installer" / "windows" / "localserve.nsi"

pytestmark = pytest.mark.skipif(shutil.which("makensis") is None, reason="makensis not installed (apt: nsis)")


def test_makensis_builds_the_installer_with_every_named_file(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next(tmp_path.glob("localserve-*.whl"))
    out = tmp_path / "localserve-installer.exe"
    done = subprocess.run(["makensis", "-V4", "-WX", f"-DWHEEL_DIR={tmp_path}", f"-DWHEEL_NAME={wheel.name}",
                           f"-DOUTFILE={out}", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr  # -WX: a warning fails the build
    assert out.read_bytes()[:2] == b"MZ"
    # Each File directive of the script, with the defines filled in, is compressed into the exe.
    script = SCRIPT.read_text()
    named = [m.replace("${WHEEL_DIR}/", "").replace("${WHEEL_NAME}", wheel.name)
             for m in re.findall(r'^\s*File\s+"([^"]+)"', script, re.M)]
    packed = re.findall(r'^File: "([^"]+)"', done.stdout, re.M)
    assert named and all(name in packed for name in named), (named, packed)
    for entry in ("localserve tray.lnk", "localserve chat.lnk", "Uninstall localserve.lnk"):
        assert f"CreateShortcut: \"$SMPROGRAMS\\localserve\\{entry}\"" in done.stdout
    assert 'WriteUninstaller: "$INSTDIR\\uninstall.exe"' in done.stdout
    assert 'ExecToLog "$INSTDIR\\venv\\Scripts\\localserve.exe" autostart on' in done.stdout


def test_makensis_refuses_a_build_without_the_wheel(tmp_path: Path) -> None:
    done = subprocess.run(["makensis", f"-DOUTFILE={tmp_path / 'x.exe'}", str(SCRIPT)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "pass the localserve wheel" in done.stdout + done.stderr
    assert not (tmp_path / "x.exe").exists()
