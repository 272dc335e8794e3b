"""The real daemon as a subprocess on a free port with a temporary LOCALSERVE_HOME: health, pid/lock
file, one daemon per home, stale pid files, graceful SIGTERM, `localserve stop`, bind refusals."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from daemon_util import (
    cli,
    cli_env,
    free_port,
    http_get,
    http_post,
    pid_file,
    register_model,
    serving,
    start_serve,
    stop_quietly,
    wait_published,
)
from localserve.config.settings import load_settings
from localserve.desktop.daemon import DaemonLock, find_daemon
from localserve.errors import DaemonError

pytestmark = pytest.mark.model


@pytest.fixture
def env(tmp_path: Path, smollm2_gguf: Path):
    env = cli_env(tmp_path, free_port())
    register_model(env, smollm2_gguf, "smol")
    yield env
    stop_quietly(env)


def home_of(env: dict[str, str]) -> Path:
    return Path(env["LOCALSERVE_HOME"])


def chat(url: str, **extra) -> tuple[int, dict]:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
    return http_post(url + "/v1/chat/completions", {**body, **extra})


def test_serve_health_pid_file_one_per_home_and_sigterm(env: dict[str, str]) -> None:
    home = home_of(env)
    with serving(env) as proc:
        info = wait_published(home, proc)
        assert info["pid"] == proc.pid and info["port"] == int(env["LOCALSERVE_PORT"])
        assert info["url"] == f"http://127.0.0.1:{env['LOCALSERVE_PORT']}"
        status, body = chat(info["url"])
        assert status == 200 and body["choices"][0]["message"]["content"].strip()

        # A second daemon for the same home refuses, even on another port, and leaves the first alone.
        second = cli({**env, "LOCALSERVE_PORT": str(free_port())}, "serve", timeout=60)
        assert second.returncode == 1
        assert "already running" in second.stderr and str(proc.pid) in second.stderr
        assert json.loads(pid_file(home).read_text())["pid"] == proc.pid

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not pid_file(home).exists()
        assert not _port_open(info["port"])
        log = (home / "logs" / "localserve.log").read_text()
        assert "listening on" in log and "stopped" in log


def test_sigterm_with_a_request_in_flight_finishes_within_the_grace(env: dict[str, str]) -> None:
    with serving(env) as proc:
        info = wait_published(home_of(env), proc)
        chat(info["url"])  # load the model
        result: dict = {}

        def long_stream() -> None:
            body = {"model": "smol", "messages": [{"role": "user", "content": "Tell a very long story."}],
                    "max_tokens": 4000, "stream": True, "temperature": 0}
            req = urllib.request.Request(info["url"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            chunks = 0
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    for line in resp:
                        chunks += line.startswith(b"data:")
                        if chunks == 3:
                            result["streaming"] = time.monotonic()
            except OSError as e:
                result["error"] = e
            result["chunks"] = chunks

        reader = threading.Thread(target=long_stream)
        reader.start()
        deadline = time.monotonic() + 30
        while "streaming" not in result and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "streaming" in result
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # LOCALSERVE_SHUTDOWN_TIMEOUT=3: the stream is cut after the grace, not after 4000 tokens.
        assert time.monotonic() - start < 15
        reader.join(30)
        assert not reader.is_alive() and result["chunks"] >= 3
        assert not pid_file(home_of(env)).exists()


def test_stale_pid_file_of_a_killed_daemon_is_replaced(env: dict[str, str]) -> None:
    home = home_of(env)
    proc = start_serve(env)
    info = wait_published(home, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert pid_file(home).exists()  # SIGKILL: no cleanup
    settings = load_settings(environ=env)
    assert find_daemon(settings) is None  # the lock died with the process: the file is stale

    status = cli(env, "ps")
    assert status.returncode == 0 and "not running" in status.stdout

    proc = start_serve(env)
    try:
        new = wait_published(home, proc)
        assert new["pid"] == proc.pid != info["pid"]
    finally:
        stop_quietly(env, proc)

    # `stop` with only a stale file left: says so and cleans it up.
    pid_file(home).parent.mkdir(parents=True, exist_ok=True)
    pid_file(home).write_text(json.dumps({**info, "pid": 999999}))
    result = cli(env, "stop")
    assert result.returncode == 0 and "not running" in result.stdout
    assert not pid_file(home).exists()


def test_stop_command_stops_the_daemon(env: dict[str, str]) -> None:
    home = home_of(env)
    with serving(env) as proc:
        info = wait_published(home, proc)
        result = cli(env, "stop")
        assert result.returncode == 0, result.stderr
        assert f"pid {info['pid']}" in result.stdout
        assert proc.wait(30) == 0
        assert not pid_file(home).exists()
        again = cli(env, "stop")
        assert again.returncode == 0 and "not running" in again.stdout


def test_lock_is_exclusive_in_process(tmp_path: Path) -> None:
    settings = load_settings(flags={"home": str(tmp_path)}, environ={}, config_path=tmp_path / "none.toml")
    first, second = DaemonLock(settings), DaemonLock(settings)
    first.acquire()
    try:
        with pytest.raises(DaemonError, match="already running"):
            second.acquire()
    finally:
        first.release()
    second.acquire()  # free again once released
    second.release()


def test_a_run_that_lost_the_start_race_waits_for_the_winner_still_starting(tmp_path: Path) -> None:
    """Our daemon exited at once (another CLI process's daemon holds the lock) while the winner was
    still loading: no pid file, no /health yet. wait_healthy waits for the winner instead of
    failing the `run` (CI saw two racing `run`s fail this way)."""
    import http.server
    import subprocess
    import sys

    from localserve.desktop.daemon import DaemonInfo, wait_healthy

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:
            pass

    settings = load_settings(flags={"home": str(tmp_path)}, environ={}, config_path=tmp_path / "none.toml")
    winner = DaemonLock(settings)
    winner.acquire()
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    url = f"http://127.0.0.1:{server.server_port}"
    ours = subprocess.Popen([sys.executable, "-c", "pass"])
    ours.wait()

    def winner_comes_up() -> None:
        time.sleep(0.5)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        winner.publish(DaemonInfo(pid=os.getpid(), url=url, host="127.0.0.1", port=server.server_port,
                                  started_at=time.time()))

    threading.Thread(target=winner_comes_up, daemon=True).start()
    try:
        assert wait_healthy(settings, timeout=20, proc=ours).url == url
    finally:
        server.shutdown()
        server.server_close()
        winner.release()


def test_non_loopback_bind_needs_an_api_key(env: dict[str, str]) -> None:
    result = cli(env, "serve", "--host", "0.0.0.0", timeout=60)
    assert result.returncode == 2
    assert "API key" in result.stderr and "Traceback" not in result.stderr
    assert not pid_file(home_of(env)).exists()


def test_port_in_use_is_a_clear_error(env: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(env["LOCALSERVE_PORT"])))
        s.listen()
        result = cli(env, "serve", timeout=60)
    assert result.returncode == 1
    assert "cannot listen on 127.0.0.1" in result.stderr and "Traceback" not in result.stderr
    assert not pid_file(home_of(env)).exists()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
