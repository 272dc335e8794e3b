"""installer/install.sh for real, in a fresh HOME: install from a wheel of this checkout, answer,
service files that verify, upgrade in place, uninstall down to the models; uninstall and purge
with LOCALSERVE_HOME on a folder of the user's own files, which stay. Plus the service texts and
the port-in-use report.

llama.cpp is not compiled again: pip gets the wheel of exactly the build this test environment
runs (found in pip's wheel cache by the hash of its libllama.so) through --find-links.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_util import cli_env, free_port, register_model, serving, stop_quietly, wait_published
from wheel_cache import wheel_of_this_build
from worker_locks import THREADS
from localserve.desktop.service import ServiceSpec, launch_agent, systemd_unit

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "installer" / "install.sh"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALSERVE_", "XDG_", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), PATH="/usr/local/bin:/usr/bin:/bin", LOCALSERVE_THREADS=str(THREADS),
               LOCALSERVE_CONTEXT_LENGTH="1024", LOCALSERVE_MAX_SEQUENCES="4", LOCALSERVE_SHUTDOWN_TIMEOUT="3")
    # The machine's pip cache (dependencies' wheels), not the fresh HOME's empty one.
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")
    env.update(extra)
    return env


def _install(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


@pytest.mark.model
def test_install_answer_upgrade_uninstall(tmp_path: Path, smollm2_gguf: Path) -> None:
    wheels = tmp_path / "wheels"
    if wheel_of_this_build(wheels) is None:
        pytest.skip("pip's cache holds no wheel of the installed llama-cpp-python build (CI's install puts it there)")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next(wheels.glob("localserve-*.whl"))
    home = tmp_path / "home"
    home.mkdir()
    data = home / ".local" / "share" / "localserve"
    env = _env(home)
    port = free_port()
    # The model, registered in place beforehand, so the installer's closing `run` downloads nothing.
    add = subprocess.run([sys.executable, "-m", "localserve", "--home", str(data), "add", str(smollm2_gguf),
                          "--name", "smollm2-135m"], env=env, capture_output=True, text=True)
    assert add.returncode == 0, add.stderr
    # What uninstall keeps: the models, not the store's lock files (localserve's, not the user's).
    models_before = [f for f in _files(data) if not f.startswith("models/.locks/")]
    ls = data / "venv" / "bin" / "localserve"
    start = time.monotonic()
    try:
        first = _install(env, "--from", str(wheel), "--find-links", str(wheels), "--port", str(port))
        print(f"first install: {time.monotonic() - start:.0f}s")
        assert first.returncode == 0, first.stdout + first.stderr
        assert first.stdout.strip().splitlines()[-1].startswith("==> done: localserve")
        assert (home / ".local" / "bin" / "localserve").resolve() == ls.resolve()
        hw = subprocess.run([str(home / ".local/bin/localserve"), "hw", "--json"], env=env, capture_output=True, text=True)
        assert '"installed": "cpu"' in hw.stdout, hw.stderr

        answer = subprocess.run([str(ls), "run", "smollm2-135m", "Say hi", "--temperature", "0", "--max-tokens", "8"],
                                env=env, capture_output=True, text=True, timeout=180)
        assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr

        unit = home / ".config" / "systemd" / "user" / "localserve.service"
        assert f'"{ls}" "serve" "--port" "{port}"' in unit.read_text()
        assert (unit.parent / "default.target.wants" / unit.name).resolve() == unit
        if shutil.which("systemd-analyze"):
            runtime = tmp_path / "run"
            runtime.mkdir(mode=0o700)
            verify = subprocess.run(["systemd-analyze", "verify", "--user", str(unit)], capture_output=True, text=True,
                                    env={**env, "XDG_RUNTIME_DIR": str(runtime)})
            # verify exits 0 even for values it ignores: its warnings name the file, so none may appear.
            assert verify.returncode == 0 and str(unit) not in verify.stderr, verify.stderr
        assert list((home / ".config" / "autostart").glob("*.desktop")), "the tray's login item"
        assert f"port = {port}" in (home / ".config" / "localserve" / "config.toml").read_text()

        python_inode = (data / "venv" / "bin" / "python").lstat().st_ino
        start = time.monotonic()
        second = _install(env, "--from", str(wheel), "--find-links", str(wheels), "--port", str(port), "--no-run")
        print(f"upgrade: {time.monotonic() - start:.0f}s")
        assert second.returncode == 0, second.stdout + second.stderr
        assert "already installed" in second.stderr.replace("\n", " ")
        assert (data / "venv" / "bin" / "python").lstat().st_ino == python_inode  # in place, not remade
    finally:
        if ls.exists():
            subprocess.run([str(ls), "stop"], env=env, capture_output=True, timeout=60)
    gone = _install(env, "--uninstall")
    assert gone.returncode == 0, gone.stderr
    assert "downloaded models kept" in gone.stdout
    assert _files(home) == [str(Path(".local/share/localserve") / f) for f in models_before]
    assert _install(env, "--purge").returncode == 0
    assert _files(home) == []


def test_uninstall_and_purge_remove_only_what_localserve_wrote(tmp_path: Path) -> None:
    """LOCALSERVE_HOME on a folder of the user's own files, some under the names localserve uses
    (logs/, batches/, models/): the real daemon, the Batch API's file store and a model registered
    in place write their entries; --uninstall removes them but the model, --purge the model too,
    and every file of the user's stays, named in what the uninstaller says it left."""
    import openai

    from localserve.store.prompt_cache import PromptDiskCache
    from onnx_helpers import write_tiny_gguf

    mine = tmp_path / "mine"
    own = {"notes.txt": "groceries", "photos/cat.jpg": "jpeg", "logs/diary.log": "day 1", "batches/plan.md": "q3",
           "models/README.md": "my models", "models/other/thing/weights.bin": "not in our layout"}
    for rel, text in own.items():
        (mine / rel).parent.mkdir(parents=True, exist_ok=True)
        (mine / rel).write_text(text)
    gguf = write_tiny_gguf(mine / "photos" / "tiny.gguf")  # the user's file, registered in place
    own_files = sorted([*own, "photos/tiny.gguf"])
    env = cli_env(mine, free_port())
    register_model(env, gguf, "tiny")
    with serving(env) as proc:
        info = wait_published(mine, proc)
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="unused", max_retries=0)
        client.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
        stop_quietly(env, proc)
    # A parked conversation on disk, as an unload writes it (store/prompt_cache.py): it holds a prompt.
    parked = PromptDiskCache(mine, "ab" * 32, "engine", 1 << 20).open()
    parked.save([1, 2, 3], b"the conversation's KV cells")
    assert parked.flush()
    written = set(_files(mine)) - set(own_files)
    manifest = "models/tiny/latest/manifest.json"
    assert {manifest, "batches/batches.sqlite3", "logs/localserve.log", "run/daemon.lock"} <= written, written
    assert any(f.startswith("batches/files/file-") for f in written), written
    assert any(f.startswith(f"prompt-cache/{'ab' * 32}/") for f in written), written

    env = _env(tmp_path / "home", LOCALSERVE_HOME=str(mine))
    (tmp_path / "home").mkdir()
    gone = _install(env, "--uninstall", timeout=60)
    assert gone.returncode == 0, gone.stderr
    assert _files(mine) == sorted([*own_files, manifest])
    left = gone.stdout.splitlines()[-1]
    assert left.startswith(f"==> left in {mine} (not removed):"), gone.stdout
    assert all(name in left.split() for name in ("batches", "logs", "models", "notes.txt", "photos")), left
    purged = _install(env, "--purge", timeout=60)
    assert purged.returncode == 0, purged.stderr
    assert _files(mine) == own_files
    assert not (mine / "models" / "tiny").exists() and not (mine / "run").exists()


def test_purge_with_localserve_home_on_the_home_directory_keeps_it(tmp_path: Path) -> None:
    """LOCALSERVE_HOME=$HOME (the review's worst case: the old uninstaller emptied it)."""
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "Documents" / "cv.odt").write_text("me")
    (home / ".bashrc").write_text("export A=1")
    purged = _install(_env(home, LOCALSERVE_HOME=str(home)), "--purge", timeout=60)
    assert purged.returncode == 0, purged.stderr
    assert _files(home) == [".bashrc", "Documents/cv.odt"]
    assert purged.stdout.splitlines()[-1] == f"==> left in {home} (not removed): Documents .bashrc"


def test_unsupported_python_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    old = tmp_path / "python3.8"
    old.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Python 3.8.18'\nexit 1\n")
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    home = tmp_path / "home"
    home.mkdir()
    done = _install(_env(home, PYTHON=str(old)), "--no-run", timeout=60)
    assert done.returncode == 1
    assert "localserve needs Python 3.10 or newer" in done.stderr and "Python 3.8.18" in done.stderr
    assert "Nothing was changed" in done.stderr and list(home.iterdir()) == []


def test_service_install_names_what_holds_the_port(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "localserve", "--home", str(tmp_path / "ls"), "--port", str(port),
                               "service", "install"], env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    me = f"(pid {os.getpid()})"
    assert f"port {port} is in use by" in done.stderr and me in done.stderr and "--port" in done.stderr
    assert not (tmp_path / ".config" / "systemd").exists()


def test_service_texts_quote_what_systemd_and_launchd_would_expand(tmp_path: Path) -> None:
    spec = ServiceSpec(Path("/opt/my apps/100%/$x/localserve"), 12345, home=Path("/data/a b"), log_dir=tmp_path)
    unit = systemd_unit(spec)
    assert 'ExecStart="/opt/my apps/100%%/$$x/localserve" "serve" "--port" "12345"' in unit
    assert 'Environment="LOCALSERVE_HOME=/data/a b"' in unit and "WantedBy=default.target" in unit
    plist = plistlib.loads(launch_agent(spec))
    assert plist["ProgramArguments"] == ["/opt/my apps/100%/$x/localserve", "serve", "--port", "12345"]
    assert plist["EnvironmentVariables"] == {"LOCALSERVE_HOME": "/data/a b"} and plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["StandardErrorPath"] == str(tmp_path / "daemon.log")
