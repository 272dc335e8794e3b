"""Durability on the real daemon: SIGKILL it mid-batch, start it again, and the batch completes
with every custom_id exactly once; then `localserve batch submit` / `results` over the CLI."""

from __future__ import annotations

import json
import signal
import time

import openai

from daemon_util import cli, cli_env, free_port, register_model, serving, stop_quietly, wait_published

MODEL = "smollm2-135m"


def chat_line(i: int) -> str:
    return json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": f"Write a word about the number {i}."}]}})


def test_sigkill_mid_batch_then_resume_exactly_once(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    env = cli_env(home, free_port())
    register_model(env, smollm2_gguf)
    n = 24
    with serving(env) as proc:
        info = wait_published(home, proc)
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="unused", max_retries=0)
        f = client.files.create(file=("in.jsonl", ("\n".join(chat_line(i) for i in range(n)) + "\n").encode()),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while client.batches.retrieve(batch.id).request_counts.completed < 3:
            assert time.monotonic() < deadline, "no line finished"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    before = None
    with serving(env) as proc:
        info = wait_published(home, proc)
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="unused", max_retries=0)
        before = client.batches.retrieve(batch.id)
        assert before.status in ("in_progress", "finalizing", "completed") and before.request_counts.completed >= 3
        deadline = time.monotonic() + 400
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert done.status == "in_progress" and time.monotonic() < deadline, done.status
            time.sleep(0.3)
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        ids = [json.loads(l)["custom_id"] for l in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(n))  # each exactly once

        # The CLI on the same daemon: submit follows to the end and writes the results beside the input.
        src = tmp_path / "small.jsonl"
        src.write_text("\n".join(chat_line(i) for i in range(3)) + "\n" + json.dumps(
            {"custom_id": "oops", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "nope"}}) + "\n")
        result = cli(env, "batch", "submit", str(src), "--model", MODEL, timeout=400)
        assert result.returncode == 0, result.stderr
        lines = [json.loads(l) for l in (tmp_path / "small.results.jsonl").read_text().splitlines()]
        assert [l["custom_id"] for l in lines] == ["line-0", "line-1", "line-2", "oops"]
        assert lines[3]["response"]["status_code"] == 400  # --model replaced "nope"; the body lacks messages
        assert "completed" in result.stderr and "3/4" not in result.stderr.splitlines()[-1]
        listed = cli(env, "batch", "list")
        assert batch.id in listed.stdout and listed.stdout.count("completed") == 2
        again = cli(env, "batch", "results", batch.id)
        assert sorted(json.loads(l)["custom_id"] for l in again.stdout.splitlines()) == sorted(ids)
        stop_quietly(env, proc)
