"""Serving benchmark: a streaming load generator for any OpenAI-compatible server.

    # one or two running servers, side by side
    python benchmarks/serve.py --url http://127.0.0.1:11480 --model smollm2-135m
    python benchmarks/serve.py --url http://127.0.0.1:11480 --url http://127.0.0.1:8000 --model smollm2-135m

    # start localserve and llama-cpp-python's own server on the same GGUF, one after the other
    # (needs `pip install -e .[bench]` for llama_cpp.server), and compare them
    python benchmarks/serve.py --launch --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

Workload: N streaming chat requests with prompts of mixed lengths (seeded, so every server gets the
same prompts), at a fixed concurrency or with Poisson arrivals (--request-rate), each asking for
--max-tokens output tokens. Reports output tokens/s, request throughput, TTFT, TPOT and ITL
percentiles and errors. Output tokens are counted from `usage` when the server sends it in the
stream, else one per content chunk (llama-cpp-python's server sends one chunk per token).

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
WORDS = (
    "the river carried small boats past the old mill while children counted clouds above the hills "
    "and a baker opened his shop early to sell warm bread to farmers who arrived from distant villages "
    "with carts of apples pears and cabbages for the market that filled the square every tuesday morning "
    "until noon when the bells of the church rang and everyone went home for lunch and a short rest"
).split()
# Mixed prompt lengths of chat messages, in words (~1.3 tokens per word, plus the chat template):
# from a quick question to a pasted paragraph. Override with --prompt-words.
PROMPT_WORDS = (4, 8, 16, 32, 64, 128)


# --- workload ----------------------------------------------------------------------------------


def make_prompts(n: int, seed: int, lengths: tuple[int, ...] = PROMPT_WORDS) -> list[str]:
    """Distinct prompts of mixed lengths; each starts differently so no server gets a free prefix."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        text = " ".join(rng.choice(WORDS) for _ in range(length))
        prompts.append(f"Note {i}: {text}. Continue this story in your own words.")
    rng.shuffle(prompts)
    return prompts


@dataclass
class Result:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> Result:
    start = time.perf_counter()
    first: float | None = None
    last = start
    chunks = 0
    usage_tokens: int | None = None
    itl: list[float] = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)
                        last = now
                        chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return Result(False, error="no tokens")
    return Result(True, output_tokens=usage_tokens or chunks, ttft=first - start, latency=end - start, itl=itl)


async def run_load(
    url: str, model: str, prompts: list[str], *, concurrency: int, request_rate: float, max_tokens: int,
    seed: int, api_key: str | None, extra: dict[str, Any],
) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gaps = random.Random(seed + 1)
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def task(prompt: str) -> Result:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            async with limit:
                return await one_request(session, url, body, headers)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(task(prompt)))
            if math.isfinite(request_rate):
                await asyncio.sleep(gaps.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    summary: dict[str, float] = {
        "requests_ok": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration else 0.0,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for q in (50, 95, 99):
            summary[f"{name}_p{q}"] = percentile(values, q)
    return summary


ROWS = [
    ("requests_ok", "requests ok", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("duration_s", "duration (s)", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.2f}"),
    ("output_tokens", "output tokens", "{:.0f}"),
    ("output_tokens_per_s", "output tokens/s", "{:.1f}"),
    *[(f"{m}_p{q}", f"{label} p{q} (ms)", "{:.1f}") for m, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")) for q in (50, 95, 99)],
]


def print_table(columns: list[tuple[str, dict[str, float]]]) -> None:
    width = max(len(label) for _, label, _ in ROWS) + 2
    col = max(14, *(len(name) + 2 for name, _ in columns))
    print("".ljust(width) + "".join(name.rjust(col) for name, _ in columns))
    for key, label, fmt in ROWS:
        print(label.ljust(width) + "".join(fmt.format(s[key]).rjust(col) for _, s in columns))
    if len(columns) == 2:
        (a_name, a), (b_name, b) = columns
        ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else float("inf")
        print(f"\n{a_name} / {b_name}: output tokens/s x{ratio:.2f}; "
              f"TTFT p95 {a['ttft_ms_p95']:.0f} ms vs {b['ttft_ms_p95']:.0f} ms")


# --- launching servers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ready(url: str, path: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with code {proc.returncode} while starting")
            try:
                async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"server at {url} not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT if sys.platform != "win32" else signal.CTRL_BREAK_EVENT)  # type: ignore[attr-defined]
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_localserve(model_path: Path, threads: int, sequences: int, work: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    # Sequences decoded together = the benchmark's concurrency, as llama-server's --parallel would be
    # set; the automatic default ties it to the thread count.
    env = dict(os.environ, LOCALSERVE_HOME=str(work / "home"), LOCALSERVE_THREADS=str(threads),
               LOCALSERVE_MAX_SEQUENCES=str(sequences),
               LOCALSERVE_CONFIG=str(work / "none.toml"))
    subprocess.run([sys.executable, "-m", "localserve", "add", str(model_path), "--name", "bench"],
                   env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    port = free_port()
    log = open(work / "localserve.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "localserve", "serve", "--port", str(port)],
                            env=env, cwd=REPO, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}", "bench"


def start_llama_cpp_server(model_path: Path, threads: int, n_ctx: int, work: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    log = open(work / "llama_cpp_server.out", "wb")
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--port", str(port),
           "--host", "127.0.0.1", "--n_ctx", str(n_ctx), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--model_alias", "bench"]
    # The same OpenMP idle policy localserve's daemon sets for itself, so only the servers differ.
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}", "bench"


async def bench_launched(args: argparse.Namespace, prompts: list[str]) -> list[tuple[str, dict[str, float]]]:
    model_path = Path(args.model_path).resolve()
    work = Path(tempfile.mkdtemp(prefix="localserve-bench-"))
    columns = []
    try:
        for name in ("localserve", "llama_cpp.server"):
            if name == "localserve":
                proc, url, model = start_localserve(model_path, args.threads, args.concurrency, work)
                ready = "/health"
            else:
                proc, url, model = start_llama_cpp_server(model_path, args.threads, args.n_ctx, work)
                ready = "/v1/models"
            try:
                await wait_ready(url, ready, proc)
                # Warm-up: loads the model (localserve loads on first use) outside the measurement.
                await run_load(url, model, ["Hello"], concurrency=1, request_rate=math.inf, max_tokens=4,
                               seed=args.seed, api_key=None, extra={})
                print(f"running {len(prompts)} requests against {name} ({url}) ...", file=sys.stderr)
                results, duration = await run_load(
                    url, model, prompts, concurrency=args.concurrency, request_rate=args.request_rate,
                    max_tokens=args.max_tokens, seed=args.seed, api_key=None, extra=args.extra)
                report_errors(name, results)
                columns.append((name, summarize(results, duration)))
            finally:
                stop(proc)
    finally:
        if args.keep_logs:
            print(f"server logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return columns


def report_errors(name: str, results: list[Result]) -> None:
    errors = [r.error for r in results if not r.ok]
    for error in sorted(set(errors))[:5]:
        print(f"{name}: {errors.count(error)} x {error}", file=sys.stderr)


async def main_async(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.num_requests, args.seed, args.prompt_words)
    if args.launch:
        if not args.model_path:
            raise SystemExit("--launch needs --model-path")
        columns = await bench_launched(args, prompts)
    else:
        if not args.url or not args.model:
            raise SystemExit("give --url (once or twice) and --model, or --launch --model-path")
        columns = []
        for url in args.url:
            url = url.rstrip("/")
            results, duration = await run_load(
                url, args.model, prompts, concurrency=args.concurrency, request_rate=args.request_rate,
                max_tokens=args.max_tokens, seed=args.seed, api_key=args.api_key, extra=args.extra)
            report_errors(url, results)
            columns.append((url, summarize(results, duration)))
    mode = "fixed concurrency" if math.isinf(args.request_rate) else f"Poisson {args.request_rate}/s"
    print(f"\n{args.num_requests} streaming requests, concurrency {args.concurrency}, {mode}, "
          f"max_tokens {args.max_tokens}, prompts of {min(args.prompt_words)}-{max(args.prompt_words)} words\n")
    print_table(columns)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(columns), indent=2))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", help="OpenAI-compatible base URL (give twice to compare)")
    p.add_argument("--model", help="model name to send")
    p.add_argument("--api-key")
    p.add_argument("--launch", action="store_true", help="start localserve and llama_cpp.server on --model-path")
    p.add_argument("--model-path", help="GGUF file for --launch")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads of both servers")
    p.add_argument("--n-ctx", type=int, default=2048, help="llama_cpp.server context")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=lambda t: tuple(int(x) for x in t.split(",")), default=PROMPT_WORDS,
                   help="comma-separated prompt lengths in words, used in turn (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", dest="extra", type=json.loads, default={}, help="JSON merged into every request")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--keep-logs", action="store_true", help="keep the launched servers' logs")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
