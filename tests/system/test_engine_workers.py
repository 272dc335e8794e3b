"""Engine worker processes: a native crash, abort or hang ends one model's requests, never the daemon.

A real daemon (`localserve serve`) serves the real SmolLM2 under two names, so each name is a model
with a worker of its own. The faults are real: signals sent to the worker process (SIGSEGV as a
crashing kernel would raise, SIGKILL as the kernel's OOM killer does, SIGSTOP for a step that never
returns), and a GGUF that llama.cpp's own loader aborts on.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from daemon_util import cli, cli_env, free_port, http_get, http_post, register_model, start_serve, stop_quietly, \
    wait_published

pytestmark = pytest.mark.model

A, B = "smollm2-135m", "second"
LIVE_S = 120  # liveness bounds only


@pytest.fixture
def daemon(tmp_path: Path, smollm2_gguf: Path) -> Iterator[dict[str, Any]]:
    env = cli_env(tmp_path / "home", free_port(), LOCALSERVE_ENGINE_HANG_TIMEOUT="4")
    register_model(env, smollm2_gguf, A)
    register_model(env, smollm2_gguf, B)
    proc = start_serve(env)
    try:
        info = wait_published(tmp_path / "home", proc)
        yield {"env": env, "url": info["url"], "home": tmp_path / "home", "proc": proc}
    finally:
        stop_quietly(env, proc)


@pytest.fixture(scope="module")
def no_eog(smollm2_gguf: Path) -> dict[str, float]:
    """logit_bias banning the end-of-generation tokens: a stream runs to its max_tokens."""
    from localserve.store.gguf_facts import read_gguf_facts

    facts = read_gguf_facts(smollm2_gguf)
    return {str(t): -100 for t in {facts.eos_token_id, 0} if t is not None}


class Stream:
    """One streamed chat in a thread: its content deltas and its frames."""

    def __init__(self, url: str, model: str, no_eog: dict[str, float], max_tokens: int = 400):
        self.url, self.model = url, model
        self.body = {"model": model, "stream": True, "max_tokens": max_tokens, "logit_bias": no_eog,
                     "messages": [{"role": "user", "content": "Write a very long story."}]}
        self.deltas: list[str] = []
        self.frames: list[dict[str, Any]] = []
        self.status = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=LIVE_S)
        conn.request("POST", "/v1/chat/completions", json.dumps(self.body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.status = response.status
        while line := response.readline():
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                frame = json.loads(line[6:])
                self.frames.append(frame)
                for choice in frame.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        self.deltas.append(choice["delta"]["content"])
        conn.close()

    @property
    def error(self) -> dict[str, Any]:
        """OpenAI's way to end a stream the server broke: an error frame, then a last chunk whose
        finish_reason is "error" (for clients that wait for one)."""
        (error,) = [f["error"] for f in self.frames if "error" in f]
        assert self.frames[-1]["choices"][0]["finish_reason"] == "error", self.frames[-1]
        return error

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + LIVE_S
        while len(self.deltas) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), (self.status, self.frames[-1:])
            time.sleep(0.02)

    def join(self) -> None:
        self.thread.join(LIVE_S)
        assert not self.thread.is_alive()


def ps(url: str) -> dict[str, dict[str, Any]]:
    status, body = http_get(url + "/api/ps")
    assert status == 200, body
    return {m["name"].split(":")[0]: m for m in json.loads(body)["models"]}


def worker_pid(url: str, model: str) -> int:
    row = ps(url)[model]
    assert row["worker"]["pid"] != os.getpid(), row
    return int(row["worker"]["pid"])


def chat(url: str, model: str, max_tokens: int = 8) -> tuple[int, dict]:
    return http_post(url + "/v1/chat/completions", {"model": model, "max_tokens": max_tokens,
                                                     "messages": [{"role": "user", "content": "Hi"}]}, timeout=LIVE_S)


def health_ms(url: str) -> float:
    t0 = time.perf_counter()
    status, _ = http_get(url + "/health")
    assert status == 200
    return (time.perf_counter() - t0) * 1000


def dashboard_models(url: str) -> dict[str, dict[str, Any]]:
    """The models of the dashboard's first live snapshot (its SSE feed, as the page reads it)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=LIVE_S)
    conn.request("GET", "/api/dashboard/stats")
    response = conn.getresponse()
    while not (line := response.readline()).startswith(b"data:"):
        pass
    conn.close()
    return {m["name"].split(":")[0]: m for m in json.loads(line[5:])["models"]}


def daemon_log(home: Path) -> str:
    return (home / "logs" / "localserve.log").read_text()


def worker_engine(home: Path, gguf: Path, **flags: Any):
    """SmolLM2 in an engine worker of this process, as the daemon's registry starts one."""
    from localserve.config.settings import load_settings
    from localserve.runtime import registry
    from localserve.runtime.manager import plan_model
    from localserve.store.cache import ModelStore

    settings = load_settings(flags={"home": str(home), **flags}, environ={}, config_path=home / "no-config.toml")
    installed = ModelStore(settings).register_local(gguf, "smol")
    return registry.load(installed, plan_model(installed, settings), settings)


def test_a_segfault_mid_stream_ends_that_stream_only_and_the_model_restarts(daemon, no_eog) -> None:
    url = daemon["url"]
    first, other = Stream(url, A, no_eog), Stream(url, B, no_eog, max_tokens=160)
    first.wait_tokens(5)
    other.wait_tokens(5)
    pid = worker_pid(url, A)
    assert pid != worker_pid(url, B) and psutil.pid_exists(pid)
    os.kill(pid, signal.SIGSEGV)
    first.join()
    # After the 200 and some tokens: the stream's error frame says what happened.
    error = first.error
    assert error["code"] == "engine_crashed", error
    assert f"the engine for {A}:latest stopped (SIGSEGV)" in error["message"], error
    # The daemon never stopped answering, and the other model's stream runs to its end.
    assert health_ms(url) < 100
    other.join()
    assert len(other.deltas) >= 150 and other.frames[-1]["choices"][0]["finish_reason"] == "length", other.frames[-1]
    # The next request loads the model again, in a new worker.
    status, body = chat(url, A)
    assert status == 200, body
    row = ps(url)[A]
    assert row["restarts"] == 1 and row["worker"]["pid"] != pid, row
    status, metrics = http_get(url + "/metrics")
    assert f'localserve_engine_restarts_total{{model="{A}:latest"}} 1.0' in metrics.decode()
    assert "stopped (SIGSEGV)" in daemon_log(daemon["home"])
    listing = cli(daemon["env"], "ps")
    assert f"pid {row['worker']['pid']}" in listing.stdout and "1 restart" in listing.stdout, listing.stdout
    shown = dashboard_models(url)[A]
    assert shown["worker"]["pid"] == row["worker"]["pid"] and shown["restarts"] == 1, shown


def _workers(daemon_pid: int) -> list[psutil.Process]:
    """The engine workers: the fork server is the daemon's child, each worker its child."""
    out = []
    for child in psutil.Process(daemon_pid).children():
        try:
            out += child.children()
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_worker_killed_while_loading_fails_that_load_only(daemon) -> None:
    url, daemon_pid = daemon["url"], daemon["proc"].pid
    result: list[tuple[int, dict]] = []
    request = threading.Thread(target=lambda: result.append(chat(url, A)), daemon=True)
    request.start()
    deadline = time.monotonic() + LIVE_S
    while not (workers := _workers(daemon_pid)):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    workers[0].kill()  # SIGKILL, as the kernel's OOM killer would
    request.join(LIVE_S)
    status, body = result[0]
    assert status == 503 and body["error"]["code"] == "engine_crashed", body
    assert "stopped (SIGKILL" in body["error"]["message"] and "while loading" in body["error"]["message"], body
    assert str(daemon["home"]) not in json.dumps(body)
    assert health_ms(url) < 100
    status, body = chat(url, A)
    assert status == 200, body


def test_a_hung_worker_is_killed_and_replaced(daemon, no_eog) -> None:
    url = daemon["url"]
    stream = Stream(url, A, no_eog)
    stream.wait_tokens(3)
    pid = worker_pid(url, A)
    os.kill(pid, signal.SIGSTOP)  # the whole process stops, as a step stuck in native code would
    t0 = time.monotonic()
    # Meanwhile the daemon answers: ps asks the stopped worker once (its quick-call bound), then
    # answers from its last figures until it is replaced.
    ps(url)
    assert health_ms(url) < 100
    t1 = time.perf_counter()
    assert ps(url)[A]["state"] == "loaded"
    assert time.perf_counter() - t1 < 0.4
    stream.join()
    waited = time.monotonic() - t0
    error = stream.error
    assert error["code"] == "engine_crashed" and "hung: no progress for" in error["message"], error
    assert 4 <= waited < 30, waited  # LOCALSERVE_ENGINE_HANG_TIMEOUT=4
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    status, body = chat(url, A)
    assert status == 200, body


def test_three_crashes_in_a_row_mark_the_model_failed_until_loaded_again(daemon) -> None:
    url = daemon["url"]
    for n in range(3):
        status, body = chat(url, A)
        assert status == 200, (n, body)
        pid = worker_pid(url, A)
        os.kill(pid, signal.SIGSEGV)
        deadline = time.monotonic() + LIVE_S
        while ps(url).get(A, {}).get("state") == "loaded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    row = ps(url)[A]
    assert row["state"] == "failed" and "3 times" in row["reason"] and "SIGSEGV" in row["reason"], row
    status, body = chat(url, A)
    assert status == 503 and body["error"]["code"] == "model_failed", body
    assert "SIGSEGV" in cli(daemon["env"], "ps").stdout
    shown = dashboard_models(url)[A]
    assert shown["state"] == "failed" and "SIGSEGV" in shown["reason"] and shown["restarts"] == 3, shown
    # The other model never noticed.
    assert chat(url, B)[0] == 200
    # Ollama's explicit load (an empty prompt) tries it afresh.
    status, body = http_post(url + "/api/generate", {"model": A}, timeout=LIVE_S)
    assert status == 200 and body["done_reason"] == "load", body
    assert chat(url, A)[0] == 200


def test_a_gguf_that_aborts_llamacpps_loader_fails_only_its_own_load(daemon, smollm2_gguf: Path) -> None:
    from aborting_gguf import aborting_gguf

    url = daemon["url"]
    register_model(daemon["env"], aborting_gguf(smollm2_gguf, daemon["home"].parent / "broken.gguf"), "broken")
    status, body = chat(url, "broken")
    assert status == 503 and body["error"]["code"] == "engine_crashed", body
    message = body["error"]["message"]
    # The file's problem in llama.cpp's own words, without the host's paths.
    assert "stopped (SIGABRT) while loading" in message and \
        "GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed" in message, message
    assert "/" not in message.split("llama-vocab.cpp")[0].rsplit(": ", 1)[-1], message
    assert health_ms(url) < 100
    assert chat(url, A)[0] == 200
    assert "GGML_ASSERT" in daemon_log(daemon["home"])


def test_a_batch_through_a_worker_crash_answers_every_line_once(daemon, no_eog) -> None:
    from openai import OpenAI

    url = daemon["url"]
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": A, "max_tokens": 48, "logit_bias": no_eog,
                       "messages": [{"role": "user", "content": f"Story {i}"}]}} for i in range(12)]
    upload = client.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + LIVE_S
    while not (row := ps(url).get(A)) or not row.get("running"):  # lines are decoding in its worker
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(row["worker"]["pid"], signal.SIGSEGV)
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline * 3
        time.sleep(0.2)
    assert batch.status == "completed", batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    assert all(x["response"]["status_code"] == 200 for x in out), [x["response"] for x in out]
    assert batch.error_file_id is None
    assert ps(url)[A]["restarts"] == 1


def test_a_gguf_models_tokenizer_runs_in_the_daemon_and_gives_the_workers_ids(tmp_path: Path, smollm2_gguf: Path) -> None:
    """tokenize and detokenize are called on the event loop: a round trip to a worker whose threads
    a busy decode keeps off the cores costs every keystroke four waits. The daemon's vocab-only load
    of the same GGUF answers instead, with the ids and text the worker's own tokenizer gives. It
    opens in the background once the worker is ready (off a cold first token's path); until then
    the worker tokenizes."""
    engine = worker_engine(tmp_path, smollm2_gguf, context_length=512, max_sequences=2)
    try:
        deadline = time.monotonic() + 30
        while engine._vocab is None:
            assert time.monotonic() < deadline, "the daemon's tokenizer never opened"
            time.sleep(0.05)
        sent: list[tuple] = []
        real_send = engine._channel.send
        engine._channel.send = lambda *message: (sent.append(message), real_send(*message))[1]
        texts = ["Hello", "", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 日本語 🎉 \ud800",
                 "def f(x):\n    return x  # " + "word " * 300]
        for text in texts:
            for add_special in (True, False):
                ids = engine.tokenize(text, add_special)
                assert sent == []  # answered here: no message to the worker
                assert ids == engine._wait("tokenize", text, add_special)
                sent.clear()
                assert engine.detokenize(ids) == engine._wait("detokenize", ids)
                sent.clear()
    finally:
        engine.shutdown()


HANG_S = 2.5  # the watchdog's limit below: a beat (each BEAT_S = 1 s) and a throttle's stop fit in it


class Throttle:
    """Stops and continues a process so that it runs `share` of every PERIOD_S (SIGSTOP and SIGCONT,
    every thread of it): a machine that much slower, on which a step runs far past the hang limit
    while it moves."""

    PERIOD_S = 0.5

    def __init__(self, pid: int, share: float):
        self.pid, self.run_s = pid, self.PERIOD_S * share
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.wait(self.run_s):
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.PERIOD_S - self.run_s)
                os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def long_prompt(engine: Any, words: str, n: int = 512) -> Any:
    """A request whose prompt of `n` tokens is one step (batch_tokens above it)."""
    from localserve.protocol.requests import GenerationRequest, SamplingParams

    tokens = engine.tokenize(f"def add(a, b):\n    return a + b\n\n# {words} " * 100)[:n]
    assert len(tokens) == n
    return GenerationRequest(prompt_tokens=tokens, max_tokens=1, sampling=SamplingParams(temperature=0))


async def events_of(stream: Any) -> list[Any]:
    return [event async for event in stream]


def longest_step(engine: Any) -> float:
    return max(step[1] for step in engine.live_steps(0.0))


async def test_a_step_far_longer_than_the_hang_limit_is_not_killed_while_it_moves(tmp_path, smollm2_gguf):
    """A prompt's step, with the worker throttled so that it lasts about 3x the hang limit: llama.cpp's
    count of graph nodes (backends/llamacpp/interrupt.py), in the worker's beats, shows it moving.
    The throttle is sized from the same step's cost unthrottled, on another prompt, just before."""
    from localserve.backends.llamacpp import interrupt

    if not interrupt.counts():
        pytest.skip("this libc's sem_post cannot count a step's graph nodes")
    engine = worker_engine(tmp_path, smollm2_gguf, context_length=1024, batch_tokens=1024, max_sequences=1,
                           engine_hang_timeout=HANG_S)
    throttle = None
    try:
        await events_of(await engine.generate(long_prompt(engine, "The quick brown fox jumps over")))
        share = min(1.0, max(0.02, longest_step(engine) / (3 * HANG_S)))
        stream = await engine.generate(long_prompt(engine, "Lorem ipsum dolor sit amet, consectetur"))
        throttle = Throttle(engine.pid, share)
        events = await asyncio.wait_for(events_of(stream), LIVE_S)
        throttle.end()
        assert events[-1].finish_reason == "length", events[-1]
        assert engine.alive and engine.exit_reason is None
        assert longest_step(engine) > HANG_S  # it was that long, and lived
    finally:
        if throttle is not None:
            throttle.end()
        engine.shutdown()


async def test_a_worker_frozen_in_its_first_step_is_killed_and_not_counted_toward_failed(tmp_path, smollm2_gguf):
    from localserve.runtime import crashes

    engine = worker_engine(tmp_path, smollm2_gguf, context_length=1024, batch_tokens=1024, max_sequences=1,
                           engine_hang_timeout=HANG_S)
    try:
        stream = await engine.generate(long_prompt(engine, "The quick brown fox jumps over"))
        os.kill(engine.pid, signal.SIGSTOP)  # the whole process stops: no step ends, no node moves
        events = await asyncio.wait_for(events_of(stream), LIVE_S)
        assert events[-1].finish_reason == "error" and "hung in its first step" in str(events[-1].error), events
        assert not engine.alive and engine.exit_reason.first_step
        assert not crashes.counts(engine.exit_reason)
    finally:
        engine.shutdown()


def test_watchdog_kills_of_a_first_step_restart_the_model_but_never_mark_it_failed() -> None:
    from localserve.engine.worker.proxy import HangReason
    from localserve.runtime.crashes import CrashBook

    book = CrashBook()
    for _ in range(4):
        book.record("m", HangReason("hung in its first step: no progress for 31 s", first_step=True))
    assert book.failed == {} and book.restarts["m"] == 4
    assert book.backoff("m") > 0  # it is not reloaded in a loop either
    book.record("m", "SIGSEGV")
    book.record("m", HangReason("hung: no progress for 31 s"))
    assert book.failed == {}  # two that count
    book.record("m", "SIGSEGV")
    assert "3 times" in book.failed["m"], book.failed
