"""Memory that follows use (issue 42): localserve beside llama.cpp's own server on the same GGUF.

    python benchmarks/memory.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

For each server, one after the other in alternating passes (never two at once: they would share the
cores and the page cache), from a fresh process:

- cold: localserve's daemon is up with nothing loaded, and the figure is its first request to first
  token (the load is inside it: the daemon loads on first use). llama-server loads at start, so its
  figure is start to ready (/health 200), and its first request's TTFT is printed beside it;
- at rest: resident memory of the whole process tree (daemon, fork server, engine workers) a few
  seconds after that first answer;
- peak: the tree's highest RSS, sampled every 0.1 s, while load A runs (serve.py's issue 8 load:
  prompts of 5-300 words, 64 tokens out, 8 at once);
- after: RSS 60 s after the load ended (issue 42's target: within 1.2x of at rest).

llama-server runs as issue 42 anchors it: `-np 8 -c 16384` (serve.py's start_llama_server);
localserve with its defaults for the model (8 sequences, the model's trained context each), so the
comparison is what each holds for the capacity it offers. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (LOADS, _tree, eog_bias, make_chats, run_load, start_llama_server,  # noqa: E402
                   start_localserve, stop, wait_ready)

SERVERS = ("localserve", "llama-server")


def tree_rss_mib(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        try:
            total += p.memory_info().rss
        except Exception:  # noqa: BLE001 - a child that ended meanwhile
            pass
    return total / 2**20


async def sample_peak(pid: int, stop_event: asyncio.Event, every_s: float = 0.1) -> float:
    peak = 0.0
    while not stop_event.is_set():
        peak = max(peak, tree_rss_mib(pid))
        await asyncio.sleep(every_s)
    return peak


async def first_token_s(url: str, model: str) -> float:
    results, _ = await run_load(url, model, ["Hello"], concurrency=1, request_rate=math.inf, max_tokens=4,
                                seed=0, api_key=None, extra={})
    if not results[0].ok:
        raise SystemExit(f"the first request failed: {results[0].error}")
    return results[0].ttft


async def one_pass(name: str, args: argparse.Namespace, model_path: Path, work: Path) -> dict[str, float]:
    started = time.perf_counter()
    if name == "localserve":
        proc, url, model = start_localserve(model_path, args.threads, 8, work)
    else:
        proc, url, model = start_llama_server(model_path, args.threads, 8, work)
    try:
        await wait_ready(url, "/health", proc)
        ready_s = time.perf_counter() - started
        first_s = await first_token_s(url, model)
        # localserve loads on the first request, llama-server before /health answers: the cold
        # figure is what a user waits for from "nothing loaded" to a token, each server's way.
        figures = {"start_to_ready_s": ready_s, "first_ttft_s": first_s,
                   "cold_s": first_s if name == "localserve" else ready_s}
        await asyncio.sleep(args.settle)
        figures["at_rest_mib"] = tree_rss_mib(proc.pid)
        lo, hi, max_tokens, system_words = LOADS["A"]
        chats = make_chats(args.num_requests, args.seed, lo, hi, system_words)
        done = asyncio.Event()
        peak = asyncio.create_task(sample_peak(proc.pid, done))
        results, duration = await run_load(url, model, chats, concurrency=8, request_rate=math.inf,
                                           max_tokens=max_tokens, seed=args.seed, api_key=None,
                                           extra={"logit_bias": eog_bias(model_path)})
        done.set()
        figures["peak_mib"] = await peak
        figures["load_a_s"] = duration
        figures["errors"] = float(sum(not r.ok for r in results))
        await asyncio.sleep(args.after)
        figures["after_mib"] = tree_rss_mib(proc.pid)
        return figures
    finally:
        stop(proc)


def print_table(columns: list[tuple[str, dict[str, float]]]) -> None:
    keys = ["cold_s", "start_to_ready_s", "first_ttft_s", "at_rest_mib", "peak_mib", "after_mib", "load_a_s", "errors"]
    print(f"{'':18}" + "".join(f"{name:>22}" for name, _ in columns))
    for key in keys:
        print(f"{key:18}" + "".join(f"{col.get(key, float('nan')):>22.2f}" for _, col in columns))


async def main_async(args: argparse.Namespace) -> None:
    model_path = Path(args.model_path).resolve()
    work = Path(tempfile.mkdtemp(prefix="localserve-memory-"))
    columns: list[tuple[str, dict[str, float]]] = []
    try:
        for pass_no in range(1, args.passes + 1):
            for name in args.servers:
                run_dir = work / f"{name}-{pass_no}"
                run_dir.mkdir()
                print(f"pass {pass_no}: {name} ...", file=sys.stderr)
                columns.append((f"{name} #{pass_no}", await one_pass(name, args, model_path, run_dir)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in args.servers:
        passes = [c for n, c in columns if n.startswith(f"{name} #")]
        columns.append((f"{name} median", {k: statistics.median(p[k] for p in passes) for k in passes[0]}))
    print_table(columns)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="the GGUF both servers load")
    p.add_argument("--servers", type=lambda t: tuple(t.split(",")), default=SERVERS)
    p.add_argument("--passes", type=int, default=2, help="alternating passes per server (default 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32, help="load A's requests (default 32)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after the first answer before 'at rest'")
    p.add_argument("--after", type=float, default=60.0, help="seconds after the load before 'after'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
