"""The prompt cache on disk as a user meets it (issue 42 part 3): a conversation parked while the
daemon idles is on disk, user-only, and the next turn reads it back after the daemon restarts and
after its engine worker was killed (SIGKILL: nothing could be written at the end), counted in
`cached_tokens`. The engine-level tests (tests/model/test_prompt_disk_cache.py) cover the file
format, spoiled and foreign files and the bound."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

from conftest import SMOLLM2_SHA256
from daemon_util import cli_env, free_port, http_post, register_model, serving, stop_quietly, wait_published
from test_engine_workers import _workers  # the fork server is the daemon's child, each worker its child

# A system prompt of a few hundred tokens, as an agent's is (shorter ones are not worth a file:
# engine/prompt_disk.MIN_TOKENS).
SYSTEM = "You are a careful assistant for a gardening shop. " + "Answer briefly and politely. " * 60


def turn(url: str, messages: list[dict[str, str]]) -> tuple[str, dict]:
    status, body = http_post(url + "/v1/chat/completions", {"model": "smollm2-135m", "messages": messages,
                                                             "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def parked_files(home: Path) -> list[Path]:
    return sorted((home / "prompt-cache" / SMOLLM2_SHA256).glob("*.kv"))


def wait_for_files(home: Path, timeout: float = 30) -> list[Path]:
    """The entry is written once it stayed parked SAVE_AFTER_S (3 s) with the engine idle."""
    deadline = time.monotonic() + timeout
    while not (files := parked_files(home)):
        assert time.monotonic() < deadline, "nothing was written to the prompt cache"
        time.sleep(0.2)
    return files


def test_a_conversation_comes_back_from_disk_after_a_restart_and_after_a_killed_worker(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    env = cli_env(home, free_port())
    register_model(env, smollm2_gguf)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which roses like shade?"}]
    try:
        with serving(env) as proc:
            url = wait_published(home, proc)["url"]
            answer, usage = turn(url, first)
            assert usage["prompt_tokens"] > 300 and cached(usage) == 0
            files = wait_for_files(home)
            # It holds a prompt: user-only, as every private place of the daemon (config/private.py).
            assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
            assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
            stop_quietly(env, proc)

        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And tulips?"}]
        with serving(env) as proc:
            url = wait_published(home, proc)["url"]
            _, usage = turn(url, second)
            # The restarted daemon computed only the new turn: the first prompt came from the file.
            assert cached(usage) >= usage["prompt_tokens"] - 40, usage
            answer2, _ = turn(url, second + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "Thanks"}])
            wait_for_files(home)
            before = {p.name for p in parked_files(home)}
            time.sleep(3.5)  # the longer conversation parked long enough to be written too
            assert {p.name for p in parked_files(home)} - before, "the second conversation was not written"
            (worker,) = _workers(proc.pid)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
            # The next request loads the model in a new worker, which finds the files the killed
            # one wrote while it idled.
            third = second + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "Thanks"},
                              {"role": "assistant", "content": answer2}, {"role": "user", "content": "Bye"}]
            _, usage = turn(url, third)
            assert cached(usage) >= usage["prompt_tokens"] - 40, usage
            stop_quietly(env, proc)
    finally:
        stop_quietly(env)
