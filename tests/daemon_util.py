"""Helpers for tests that run the real CLI and daemon as subprocesses on a temporary home."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from worker_locks import THREADS

REPO = Path(__file__).resolve().parent.parent
# Test daemons answer with speculation off, the mode that promises bit-exact, load-independent
# greedy answers: the product's default, auto, drafts or not by the step times it measures, and a
# drafted answer can part from a plain one at a near-tie (docs/architecture.md). Tests that compare
# answers across runs, lanes or daemons (a batch line against the same request alone, one upstream
# against another) failed that way under load. tests/model/test_speculation.py turns it on where it tests it.
SPECULATIVE = "off"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_env(home: Path, port: int, **extra: str) -> dict[str, str]:
    """Environment of a CLI/daemon subprocess: only this home and port, small engine, no user config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALSERVE_")}
    env.update(
        PYTHONPATH=str(REPO),
        LOCALSERVE_HOME=str(home),
        LOCALSERVE_PORT=str(port),
        LOCALSERVE_CONFIG=str(home / "no-config.toml"),
        LOCALSERVE_THREADS=str(THREADS),
        LOCALSERVE_CONTEXT_LENGTH="1024",
        LOCALSERVE_MAX_SEQUENCES="4",
        LOCALSERVE_SHUTDOWN_TIMEOUT="3",
        LOCALSERVE_SPECULATIVE=SPECULATIVE,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def cli(env: dict[str, str], *args: str, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localserve", *args],
        env=env, cwd=REPO, input=input, capture_output=True, text=True, timeout=timeout,
    )


class ServeProcess(subprocess.Popen):
    """A foreground `serve` whose stdout and stderr go to one unnamed temporary file, read with
    output(). Not pipes: nobody reads a pipe while the daemon runs, and a foreground daemon logs
    every request to stderr (aiohttp's access log), so a test that polls it a few hundred times
    filled the 64 KiB pipe and the daemon's event loop blocked in a write to it for good (CI's
    test_upstream: the front daemon stopped answering after ~400 /api/ps polls)."""

    def __init__(self, env: dict[str, str], *args: str):
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        super().__init__([sys.executable, "-m", "localserve", "serve", *args],
                         env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        """Everything the daemon printed so far (its stdout and stderr, interleaved)."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()


def start_serve(env: dict[str, str], *args: str) -> ServeProcess:
    return ServeProcess(env, *args)


@contextmanager
def serving(env: dict[str, str], *args: str) -> Iterator[ServeProcess]:
    """A foreground `serve` subprocess, killed on the way out if the test left it running."""
    proc = start_serve(env, *args)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pid_file(home: Path) -> Path:
    return home / "run" / "daemon.json"


def wait_published(home: Path, proc: ServeProcess | None = None, timeout: float = 60) -> dict:
    """The daemon's pid file once it answers /health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {proc.output()}")
        try:
            info = json.loads(pid_file(home).read_text())
            if http_get(info["url"] + "/health")[0] == 200:
                return info
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError("daemon did not become healthy")


def http_get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def register_model(env: dict[str, str], gguf: Path, name: str = "smollm2-135m") -> None:
    """`localserve add` the cached test model into this home (no download)."""
    result = cli(env, "add", str(gguf), "--name", name)
    assert result.returncode == 0, result.stderr


def stop_quietly(env: dict[str, str], proc: subprocess.Popen[str] | None = None) -> None:
    """Teardown: stop whatever daemon this home runs, never leaving a process behind."""
    cli(env, "stop", "--timeout", "30", timeout=60)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)


@contextmanager
def attacked_daemon(home: Path, gguf: Path) -> Iterator[tuple[dict, subprocess.Popen[str]]]:
    """A foreground daemon on `home` serving the cached model as `smol`, for attack suites: it must
    still be alive when they are done."""
    env = cli_env(home, free_port())
    register_model(env, gguf, "smol")
    with serving(env) as proc:
        yield wait_published(home, proc), proc
        assert proc.poll() is None, "the daemon died during the attacks"
        stop_quietly(env, proc)
