"""Serving benchmark: a streaming load generator for any OpenAI-compatible server.

    # one or two running servers, side by side
    python benchmarks/serve.py --url http://127.0.0.1:11480 --model smollm2-135m
    python benchmarks/serve.py --url http://127.0.0.1:11480 --url http://127.0.0.1:8000 --model smollm2-135m

    # start localserve, llama.cpp's own llama-server (built once from the sources the pinned
    # llama-cpp-python vendors: benchmarks/llama_server_build.py) and llama-cpp-python's server
    # (`pip install -e .[bench]`) on the same GGUF, one after the other in alternating passes
    # (--passes, default 2: A B A B), and print one table: each pass, each server's median, and
    # llama-batched-bench's ceiling for the same GGUF and threads (--no-ceiling skips it)
    python benchmarks/serve.py --launch --load A --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf
    # interactive TTFT while 16 batch-lane requests saturate each server, idle vs under the flood
    python benchmarks/serve.py --launch --flood --model-path ...
    # what open dashboards cost: localserve alone, then with 4 pages' SSE streams open
    # (/api/dashboard/stats, read as a page reads them), in alternating passes
    python benchmarks/serve.py --launch --servers localserve,localserve+dashboards --dashboards 4 --load B --no-ceiling ...
    # what the engine worker processes cost: models in a worker (the default) vs inside the daemon
    python benchmarks/serve.py --launch --servers localserve,localserve+inline,llama-server --load B --no-ceiling ...
    # this checkout beside the daemon as it was at an older commit (same llama-cpp-python), and llama-server
    python benchmarks/serve.py --launch --servers localserve@65abf1a,localserve,llama-server-fa-off --load A --no-ceiling ...

Loads (--load), as issue 8 defines them: A prompts of 5-300 words, 64 tokens out; B 5-40 words,
128 out; C the same ~1,000-token system prompt on every request, 5-40-word questions, 64 out.
Every answer has its full length: end-of-generation tokens are banned with logit_bias.

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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_server_build
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


# name: (prompt words lo, hi, tokens out, system prompt words)
LOADS = {"A": (5, 300, 64, 0), "B": (5, 40, 128, 0), "C": (5, 40, 64, 750)}
FLOOD_REQUESTS, FLOOD_PROBES = 16, 8


def make_chats(n: int, seed: int, lo: int, hi: int, system_words: int = 0) -> list[list[dict[str, str]]]:
    """n distinct chats of lo..hi words each, behind one shared system prompt when system_words."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_words))
    chats = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        chat = [{"role": "user", "content": f"Note {i}: {text}. Continue this story in your own words."}]
        chats.append(([{"role": "system", "content": f"You are a storyteller. {system}"}] if system else []) + chat)
    return chats


def eog_bias(model_path: Path | None) -> dict[str, float]:
    """logit_bias that bans the model's end-of-generation tokens, so every answer runs to max_tokens."""
    if model_path is None:
        return {}
    sys.path.insert(0, str(REPO))
    from localserve.store.gguf_facts import read_gguf_facts

    facts = read_gguf_facts(model_path)
    ids = {t for t in (facts.eos_token_id, 0) if t is not None}  # 0: <|endoftext|> of gpt2-style vocabularies
    return {str(t): -100 for t in sorted(ids)}


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


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat: its text, completion tokens, TTFT, decode seconds and last usage."""
    start = time.perf_counter()
    first, text, usage = None, [], {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": usage.get("completion_tokens", 0), "ttft": (first or end) - start,
            "decode_s": end - (first or end), "usage": usage}


async def run_load(
    url: str, model: str, prompts: list[str] | list[list[dict[str, str]]], *, concurrency: int, request_rate: float,
    max_tokens: int, seed: int, api_key: str | None, extra: dict[str, Any],
) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gaps = random.Random(seed + 1)
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)

    # A fresh connection per request: llama-server closes a streamed response's connection, and
    # aiohttp reusing it from its pool failed a fifth of llama-server's requests with "Can not
    # write request body". Connecting costs ~0.1 ms on localhost, the same for every server.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:

        async def task(prompt: str | list[dict[str, str]]) -> Result:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
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
    ("idle_cpu_percent", "idle CPU after (% core)", "{:.1f}"),
    ("rss_server_mib", "RSS, server process (MiB)", "{:.0f}"),
    ("rss_children_mib", "RSS, its child processes (MiB)", "{:.0f}"),
]


def print_table(columns: list[tuple[str, dict[str, float]]]) -> None:
    width = max(len(label) for _, label, _ in ROWS) + 2
    col = max(14, *(len(name) + 2 for name, _ in columns))
    print("".ljust(width) + "".join(name.rjust(col) for name, _ in columns))
    for key, label, fmt in ROWS:
        if any(key in s for _, s in columns):  # idle CPU: only servers this run launched
            print(label.ljust(width) + "".join(fmt.format(s.get(key, math.nan)).rjust(col) for _, s in columns))
    anchor = next((c for c in columns if c[0] == "llama-server"), columns[-1] if len(columns) == 2 else None)
    for name, c in columns:
        if anchor is None or name == anchor[0]:
            continue
        b = anchor[1]
        ratio = c["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else float("inf")
        ttft = c["ttft_ms_p95"] / b["ttft_ms_p95"] if b["ttft_ms_p95"] else float("inf")
        print(f"{name} / {anchor[0]}: output tokens/s x{ratio:.2f}, TTFT p95 x{ttft:.2f} "
              f"({c['ttft_ms_p95']:.0f} ms vs {b['ttft_ms_p95']:.0f} ms)")


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


def localserve_env(threads: int, sequences: int, work: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark's daemon: a fresh LOCALSERVE_HOME under `work`, no config file."""
    # Sequences decoded together = the benchmark's concurrency, as llama-server's --parallel would be
    # set; the automatic default ties it to the thread count.
    return dict(os.environ, LOCALSERVE_HOME=str(work / "home"), LOCALSERVE_THREADS=str(threads),
                LOCALSERVE_MAX_SEQUENCES=str(sequences),
                LOCALSERVE_CONFIG=str(work / "none.toml"), **(extra_env or {}))


def start_localserve(model_path: Path | None, threads: int, sequences: int, work: Path,
                     extra_env: dict[str, str] | None = None,
                     tree: Path = REPO) -> tuple[subprocess.Popen[bytes], str, str]:
    """A daemon in a fresh LOCALSERVE_HOME under `work`, serving model_path as "bench"; without a
    model_path it has no local model (upstream_vllm.py gives it an upstream in extra_env). `tree`:
    the source tree it runs from (another commit's, from commit_tree), this checkout's by default."""
    env = localserve_env(threads, sequences, work, extra_env) | {"PYTHONPATH": str(tree)}
    if model_path is not None:
        subprocess.run([sys.executable, "-m", "localserve", "add", str(model_path), "--name", "bench"],
                       env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return (*serve_localserve(env, work, tree), "bench")


def serve_localserve(env: dict[str, str], work: Path, tree: Path = REPO) -> tuple[subprocess.Popen[bytes], str]:
    """`localserve serve` in `env` on a free port (start_localserve's, or again after a stop), its
    output appended to work/localserve.out."""
    port = free_port()
    log = open(work / "localserve.out", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "localserve", "serve", "--port", str(port)],
                            env=env, cwd=tree, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}"


def commit_tree(rev: str, into: Path) -> Path:
    """This repository's files at `rev`, unpacked under `into` (once per run), for a `localserve@REV`
    server: an issue's "at least today's ratio" is read against the commit it was filed on, in the
    same run on the same machine, rather than against a figure another machine measured. It runs on
    this checkout's virtual environment, so `rev` must pin the same llama-cpp-python."""
    tree = into / f"tree-{rev}"
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def start_llama_server(model_path: Path, threads: int, sequences: int, work: Path,
                       extra_args: list[str] | None = None,
                       slot_ctx: int = 2048) -> tuple[subprocess.Popen[bytes], str, str]:
    """llama.cpp's C++ server, as issue 8 anchors it: -np 8 -c 16384 (`slot_ctx`, 2,048, cells per slot)."""
    from llama_server_build import llama_server_binary

    port = free_port()
    log = open(work / "llama_server.out", "wb")
    cmd = [str(llama_server_binary()), "-m", str(model_path), "--port", str(port), "--host", "127.0.0.1",
           "-np", str(sequences), "-c", str(slot_ctx * sequences), "-t", str(threads), "-a", "bench",
           *(extra_args or [])]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log), f"http://127.0.0.1:{port}", "bench"


def start_llama_cpp_server(model_path: Path, threads: int, n_ctx: int, work: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    log = open(work / "llama_cpp_server.out", "wb")
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--port", str(port),
           "--host", "127.0.0.1", "--n_ctx", str(n_ctx), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--model_alias", "bench"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}", "bench"


SERVERS = ("localserve", "llama-server", "llama_cpp.server")
# localserve again, with --dashboards pages' live streams open during the load (not in the default set)
WITH_DASHBOARDS = "localserve+dashboards"
# localserve with its model inside the daemon's own process (engine_workers off), to price the
# engine worker processes (engine/worker/) against (not in the default set)
INLINE = "localserve+inline"
# llama-server without flash attention, as localserve runs: its default (-fa auto, on) is its slower
# choice on a CPU (load B 113.0 with it, 122.1 without, two runs of 2026-12-05), so this is the stronger anchor (not in the
# default set, which keeps the anchor issue 8 defined)
FA_OFF = "llama-server-fa-off"
# localserve@REV: the daemon as it was at commit REV (commit_tree), beside this checkout's
AT_COMMIT = "localserve@"
READY = {"localserve": "/health", WITH_DASHBOARDS: "/health", INLINE: "/health", "llama-server": "/health",
         FA_OFF: "/health", "llama_cpp.server": "/v1/models"}


def launch(name: str, args: argparse.Namespace, model_path: Path, work: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    if name.startswith(AT_COMMIT):
        tree = commit_tree(name.removeprefix(AT_COMMIT), work.parent)
        return start_localserve(model_path, args.threads, args.concurrency, work, dict(args.localserve_env), tree)
    if name in ("localserve", WITH_DASHBOARDS, INLINE):
        env = dict(args.localserve_env) | ({"LOCALSERVE_ENGINE_WORKERS": "0"} if name == INLINE else {})
        return start_localserve(model_path, args.threads, args.concurrency, work, env)
    if name in ("llama-server", FA_OFF):
        return start_llama_server(model_path, args.threads, args.concurrency, work,
                                  extra_args=["-fa", "off"] if name == FA_OFF else None)
    return start_llama_cpp_server(model_path, args.threads, args.n_ctx, work)


async def bench_launched(args: argparse.Namespace, prompts: list[Any]) -> list[tuple[str, dict[str, float]]]:
    """The servers in alternating passes (A B A B ...), never two at once (they would share the
    cores); a column per pass, then each server's median, so one noisy pass cannot decide."""
    model_path = Path(args.model_path).resolve()
    work = Path(tempfile.mkdtemp(prefix="localserve-bench-"))
    columns = []
    try:
        for pass_no in range(1, args.passes + 1):
            for name in args.servers:
                run_dir = work / f"{name}-{pass_no}"
                run_dir.mkdir()
                summary = await bench_one(name, args, model_path, run_dir, prompts)
                columns.append((f"{name} #{pass_no}" if args.passes > 1 else name, summary))
                print(f"pass {pass_no}, {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in summary.items()
                                                                if k in PASS_KEYS), file=sys.stderr)
    finally:
        if args.keep_logs:
            print(f"server logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.passes > 1:
        columns += [(f"{name} median", median_of([c for n, c in columns if n.startswith(f"{name} #")]))
                    for name in args.servers]
    return columns


async def bench_one(name: str, args: argparse.Namespace, model_path: Path, work: Path,
                    prompts: list[Any]) -> dict[str, float]:
    proc, url, model = launch(name, args, model_path, work)
    try:
        await wait_ready(url, READY.get(name, "/health"), proc)
        # Warm-up: loads the model (localserve loads on first use) outside the measurement.
        await run_load(url, model, ["Hello"], concurrency=1, request_rate=math.inf, max_tokens=4,
                       seed=args.seed, api_key=None, extra={})
        print(f"running {'the flood' if args.flood else f'{len(prompts)} requests'} against {name} "
              f"({url}) ...", file=sys.stderr)
        if args.flood:
            return await flood(url, model, args)
        pages = [asyncio.create_task(read_dashboard(url)) for _ in range(args.dashboards)] \
            if name == WITH_DASHBOARDS else []
        try:
            results, duration = await run_load(
                url, model, prompts, concurrency=args.concurrency, request_rate=args.request_rate,
                max_tokens=args.max_tokens, seed=args.seed, api_key=None, extra=args.extra)
        finally:
            for page in pages:
                page.cancel()
        report_errors(name, results)
        summary = summarize(results, duration)
        if pages:
            print(f"{len(pages)} dashboard streams were open during the load", file=sys.stderr)
        summary["idle_cpu_percent"] = await idle_cpu_percent(proc.pid)
        summary.update(rss_mib(proc.pid))
        return summary
    finally:
        stop(proc)


async def read_dashboard(url: str) -> None:
    """One open dashboard page's live feed: the SSE stream of snapshots, parsed as the page does."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/api/dashboard/stats") as response:
            async for line in response.content:
                if line.startswith(b"data:"):
                    json.loads(line[5:])


PASS_KEYS = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p95", "flood_over_idle_p95", "flood_tokens_per_s")


def median_of(summaries: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}


def batched_ceiling(model_path: Path, threads: int, npl: str = "1,8,16",
                    extra: tuple[str, ...] = ()) -> dict[str, float]:
    """llama.cpp's own llama-batched-bench on the same GGUF and threads: prompt tok/s (128-token
    prompts) and generation tok/s at 1, 8 and 16 sequences, the most this machine can do. Flash
    attention off, as localserve runs: on, its CPU kernel gives 145.9 tok/s at 8 sequences where
    off gives 175.7 (2026-12-05), so "auto" (on) understated the ceiling. `extra`: more arguments
    (gpu_check.py's "-ngl 999")."""
    from llama_server_build import tool_binary

    out = subprocess.run([str(tool_binary("llama-batched-bench")), "-m", str(model_path), "-c", "8192",
                          "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", npl,
                          "-t", str(threads), "-fa", "off", "--load-mode", "none", *extra],  # the vendored build has no --no-mmap
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    ceiling = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
        if len(cells) >= 8 and cells[0] == "128" and cells[2].isdigit():
            ceiling[f"prompt_tokens_per_s_b{cells[2]}"] = float(cells[5])
            ceiling[f"gen_tokens_per_s_b{cells[2]}"] = float(cells[7])
    return ceiling


async def idle_cpu_percent(pid: int, settle_s: float = 2.0, window_s: float = 5.0) -> float:
    """CPU the server burns with its model loaded and no requests, as % of one core, measured
    over `window_s` after `settle_s` of quiet: a desktop daemon must idle at ~0 (OpenMP workers
    that spin forever, OMP_WAIT_POLICY=ACTIVE, show up here as ~100)."""
    await asyncio.sleep(settle_s)
    before = tree_cpu_seconds(pid)
    await asyncio.sleep(window_s)
    return 100 * (tree_cpu_seconds(pid) - before) / window_s


def _tree(pid: int) -> list[Any]:
    """The server and every process under it (localserve's engine workers and their fork server)."""
    import psutil

    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except Exception:  # noqa: BLE001 - a child that ended meanwhile
            pass
    return total


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of the server process and, apart, of its children: with engine workers the
    model's weights and KV live in a worker, so the daemon's own figure shrinks to its Python."""
    server, *children = _tree(pid)
    rss = [p.memory_info().rss for p in children if p.is_running()]
    return {"rss_server_mib": server.memory_info().rss / 2**20, "rss_children_mib": sum(rss) / 2**20}


async def probe_ttfts(url: str, model: str, args: argparse.Namespace, seed: int) -> list[float]:
    """TTFT (ms) of FLOOD_PROBES short interactive chats, one after another."""
    out = []
    for chat in make_chats(FLOOD_PROBES, seed, 5, 20):
        results, _ = await run_load(url, model, [chat], concurrency=1, request_rate=math.inf, max_tokens=8,
                                    seed=seed, api_key=None, extra={**args.extra, "priority": "interactive"})
        out += [r.ttft * 1000 for r in results if r.ok]
        await asyncio.sleep(0.3)
    return out


async def flood(url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    """Interactive TTFT idle, then while FLOOD_REQUESTS long-prompt batch-lane chats saturate the server."""
    idle = await probe_ttfts(url, model, args, args.seed + 100)
    batch = make_chats(FLOOD_REQUESTS, args.seed + 200, 250, 300)
    flood_task = asyncio.create_task(run_load(
        url, model, batch, concurrency=FLOOD_REQUESTS, request_rate=math.inf, max_tokens=128, seed=args.seed,
        api_key=None, extra={**args.extra, "priority": "batch"}))
    await asyncio.sleep(1.0)  # the flood's prompts are in
    loaded = await probe_ttfts(url, model, args, args.seed + 300)
    results, duration = await flood_task
    report_errors("flood", results)
    flood_tokens = sum(r.output_tokens for r in results if r.ok)
    return {"idle_ttft_ms_p50": percentile(idle, 50), "idle_ttft_ms_p95": percentile(idle, 95),
            "flood_ttft_ms_p50": percentile(loaded, 50), "flood_ttft_ms_p95": percentile(loaded, 95),
            "flood_over_idle_p95": percentile(loaded, 95) / percentile(idle, 95),
            "flood_tokens_per_s": flood_tokens / duration if duration else 0.0,
            "flood_errors": sum(not r.ok for r in results), "flood_duration_s": duration}


FLOOD_ROWS = [
    ("idle_ttft_ms_p50", "interactive TTFT idle p50 (ms)", "{:.0f}"),
    ("idle_ttft_ms_p95", "interactive TTFT idle p95 (ms)", "{:.0f}"),
    ("flood_ttft_ms_p50", "... under the flood p50 (ms)", "{:.0f}"),
    ("flood_ttft_ms_p95", "... under the flood p95 (ms)", "{:.0f}"),
    ("flood_over_idle_p95", "flood / idle p95", "x{:.2f}"),
    ("flood_tokens_per_s", "flood output tokens/s", "{:.1f}"),
    ("flood_duration_s", "flood duration (s)", "{:.1f}"),
    ("flood_errors", "flood errors", "{:.0f}"),
]


def report_errors(name: str, results: list[Result]) -> None:
    errors = [r.error for r in results if not r.ok]
    for error in sorted(set(errors))[:5]:
        print(f"{name}: {errors.count(error)} x {error}", file=sys.stderr)


async def main_async(args: argparse.Namespace) -> int:
    if args.load:
        lo, hi, args.max_tokens, system_words = LOADS[args.load]
        prompts: list[Any] = make_chats(args.num_requests, args.seed, lo, hi, system_words)
        args.prompt_words = (lo, hi)
    else:
        prompts = make_prompts(args.num_requests, args.seed, args.prompt_words)
    if args.model_path and "logit_bias" not in args.extra:
        args.extra = {**args.extra, "logit_bias": eog_bias(Path(args.model_path))}
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
    if args.flood:
        print(f"\n{FLOOD_PROBES} interactive chats (5-20 words, 8 out), idle, then while {FLOOD_REQUESTS} batch-lane "
              f"chats (250-300 words, 128 out) run\n")
        width = max(len(label) for _, label, _ in FLOOD_ROWS) + 2
        print("".ljust(width) + "".join(name.rjust(18) for name, _ in columns))
        for key, label, fmt in FLOOD_ROWS:
            print(label.ljust(width) + "".join(fmt.format(c[key]).rjust(18) for _, c in columns))
    else:
        mode = "fixed concurrency" if math.isinf(args.request_rate) else f"Poisson {args.request_rate}/s"
        load = f"load {args.load}, " if args.load else ""
        print(f"\n{load}{args.num_requests} streaming requests, concurrency {args.concurrency}, {mode}, "
              f"max_tokens {args.max_tokens}, prompts of {min(args.prompt_words)}-{max(args.prompt_words)} words"
              + (f" behind a {LOADS['C'][3]}-word system prompt" if args.load == "C" else "") + "\n")
        print_table(columns)
    if args.launch and args.ceiling:
        ceiling = batched_ceiling(Path(args.model_path).resolve(), args.threads)
        print("\nllama-batched-bench on the same GGUF and threads (128-token prompts, 128 out): "
              + ", ".join(f"{k} {v:.1f}" for k, v in ceiling.items()))
        columns.append(("ceiling", ceiling))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(columns), indent=2))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", help="OpenAI-compatible base URL (give twice to compare)")
    p.add_argument("--model", help="model name to send")
    p.add_argument("--api-key")
    p.add_argument("--launch", action="store_true", help="start the --servers one after another on --model-path")
    p.add_argument("--servers", type=lambda t: tuple(t.split(",")), default=None,
                   help=f"comma-separated, of {','.join(SERVERS)}, {WITH_DASHBOARDS}, {INLINE}, {FA_OFF}, {AT_COMMIT}REV "
                        "(default: the first three; --flood: the first two)")
    p.add_argument("--passes", type=int, default=2, help="alternating passes per server with --launch (default 2)")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="skip llama-batched-bench's hardware ceiling after the passes")
    p.add_argument("--load", choices=sorted(LOADS), help="issue 8's workloads (sets prompts and --max-tokens)")
    p.add_argument("--flood", action="store_true", help="interactive TTFT idle vs under a batch-lane flood")
    p.add_argument("--model-path", help="GGUF file for --launch")
    p.add_argument("--dashboards", type=int, default=4,
                   help="dashboard SSE streams open during the load of the localserve+dashboards server (default 4)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads of every server")
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
    p.add_argument("--localserve-env", action="append", default=[], type=lambda t: tuple(t.split("=", 1)),
                   metavar="NAME=VALUE", help="environment of the launched localserve only (to try a setting)")
    p.add_argument("--keep-logs", action="store_true", help="keep the launched servers' logs")
    args = p.parse_args(argv)
    # llama_cpp.server decodes one request at a time: a 16-request flood would only time its queue.
    args.servers = args.servers or (SERVERS[:2] if args.flood else SERVERS)
    if unknown := {s for s in args.servers if not s.startswith(AT_COMMIT)} - set(SERVERS) - {WITH_DASHBOARDS, INLINE, FA_OFF}:
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
