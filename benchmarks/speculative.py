"""Speculative decoding benchmark: an edit workload and load B, localserve with speculative=auto vs
off, and llama.cpp's llama-server without and with its own n-gram speculation, on the same GGUF,
one server at a time, in one run.

    python benchmarks/speculative.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf
    # auto against off alone, in alternating passes (auto off auto off), median and each pass
    python benchmarks/speculative.py --servers localserve,localserve-off --concurrency 1 --passes 2 --model-path ...

Edit workload: real source files of 159-215 lines (--files; by default four modules of ours as they
read at commit EDIT_COMMIT, so the workload does not drift as the code does), each sent with an
instruction to return it with one small change (a different identifier renamed per request, placed
before the file, so no two requests share a cached prefix), greedy, --max-tokens of output each with
end-of-generation banned (full length). At each --concurrency c, max(c, files) requests, request i
on file i mod files, c at a time. Load B (serve.py's: 5-40-word chats, 128 tokens out) at
concurrency 8.

Why several files: an answer's speed-up is set by how much of it repeats text the request already
holds, and one greedy answer can take another road at a near-tie (docs/architecture.md), after
which it copies more or less. One file's figure moved from x2.32 to x1.85 that way. SmolLM2-135M
often describes the file instead of returning it, so the table also gives `copied`: the median
share of an answer's lines found verbatim in its source file (1.0: the model did the edit).

Prints per server and workload: output tokens/s (all output over the wall time), decode tokens/s
(after each request's first token: what speculation changes; the median per request and `all`,
every request's decode tokens over their decode seconds), TTFT p50, `copied`, and for localserve
the draft tokens verified and accepted (/metrics). Also how many of localserve's greedy edit
answers with speculation equal those without.

Figures, not assertions: tests never time anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (LOADS, REPO, eog_bias, make_chats, percentile, start_llama_server, start_localserve, stop,  # noqa: E402
                   stream_chat, wait_ready)

# (launcher, extra) per server name: localserve's env, llama-server's flags.
SERVERS: dict[str, tuple[str, Any]] = {
    "localserve": ("localserve", {"LOCALSERVE_SPECULATIVE": "auto"}),
    "localserve-off": ("localserve", {"LOCALSERVE_SPECULATIVE": "off"}),
    "llama-server": ("llama-server", []),
    "llama-server+ngram": ("llama-server", ["--spec-type", "ngram-mod"]),
    # Its default flash attention ("auto": on) costs a CPU dearly at an edit's 2-3k tokens of
    # context (docs/architecture.md); off, as localserve runs, is the stronger anchor there.
    "llama-server-fa-off": ("llama-server", ["-fa", "off"]),
    "llama-server+ngram-fa-off": ("llama-server", ["--spec-type", "ngram-mod", "-fa", "off"]),
}
RENAMES = ["request", "sampler", "tokens", "status", "stream", "cells", "order", "seq_id"]
EDIT_COMMIT = "ce5589c"
EDIT_FILES = ["localserve/batching/sequence.py", "localserve/batching/kvpool.py",
              "localserve/batching/prefix_cache.py", "localserve/api/anthropic_stream.py"]


def read_source(spec: str) -> str:
    """A file's text: `COMMIT:PATH` from this repository's history (the default workload, pinned),
    else a path on disk."""
    commit, sep, path = spec.partition(":")
    if not sep:
        return Path(spec).read_text()
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True)
    if shown.returncode != 0:  # a shallow clone lacks the commit: say so, never measure another text
        raise SystemExit(f"cannot read {spec} (git: {shown.stderr.strip()}); pass --files PATH,...")
    return shown.stdout


def copied_share(source: str, answer: str) -> float:
    """Share of the answer's non-blank lines (code fences aside) found verbatim in the source."""
    lines = [line.rstrip() for line in answer.splitlines() if line.strip() and not line.startswith("```")]
    known = {line.rstrip() for line in source.splitlines()}
    return sum(line in known for line in lines) / len(lines) if lines else 0.0


def edit_messages(source: str, i: int) -> list[dict[str, str]]:
    name = RENAMES[i % len(RENAMES)]
    return [{"role": "user", "content": f"Rename `{name}` to `{name}_{i}` in this Python file and return the "
                                        f"whole file, nothing else:\n\n{source}"}]


async def wave(url: str, model: str, conversations: list[list[dict[str, str]]], max_tokens: int,
               bias: dict[str, float], concurrency: int) -> tuple[list[dict[str, Any]], float]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        async def one(messages):
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias}
            async with limit:
                return await stream_chat(session, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in conversations))
        return list(results), time.perf_counter() - start


async def drafts(url: str) -> tuple[int, int]:
    """Draft tokens verified and accepted so far, all lanes, from /metrics."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    totals = {"localserve_draft_tokens_total": 0.0, "localserve_draft_accepted_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return int(totals["localserve_draft_tokens_total"]), int(totals["localserve_draft_accepted_tokens_total"])


def summary(results: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    tokens = sum(r["tokens"] for r in results)
    timed = [r for r in results if r["decode_s"] > 0]
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in timed]
    return {"output_tok_s": tokens / seconds, "decode_tok_s_per_request": statistics.median(rates),
            "decode_tok_s_all": sum(r["tokens"] - 1 for r in timed) / sum(r["decode_s"] for r in timed),
            "ttft_ms_p50": percentile([r["ttft"] * 1000 for r in results], 50)}


async def bench_server(name: str, args: argparse.Namespace, work: Path, sources: list[str]) -> dict[str, Any]:
    launcher, extra = SERVERS[name]
    if launcher == "localserve":
        proc, url, model = start_localserve(args.model_path, args.threads, 8, work, extra)
    else:
        # 4,096 cells a slot: an edit's prompt (up to ~2,800 tokens) and its answer must fit, as
        # they do in localserve's per-sequence context; at 2,048 llama-server refuses the prompt.
        proc, url, model = start_llama_server(args.model_path, args.threads, 8, work, extra_args=extra, slot_ctx=4096)
    bias = eog_bias(args.model_path)
    out: dict[str, Any] = {}
    try:
        await wait_ready(url, "/health", proc)
        await wave(url, model, [[{"role": "user", "content": "Hello"}]], 4, {}, 1)  # loads the model
        for c in args.concurrency:
            before = await drafts(url) if launcher == "localserve" else (0, 0)
            picked = [sources[i % len(sources)] for i in range(max(c, len(sources)))]
            results, seconds = await wave(url, model, [edit_messages(src, c * 10 + i) for i, src in enumerate(picked)],
                                          args.max_tokens, bias, c)
            after = await drafts(url) if launcher == "localserve" else (0, 0)
            copied = statistics.median(copied_share(src, r["text"]) for src, r in zip(picked, results))
            out[f"edit c={c}"] = summary(results, seconds) | {
                "copied": copied, "drafted": after[0] - before[0], "accepted": after[1] - before[1]}
            out[f"texts c={c}"] = [r["text"] for r in results]
            print(f"{name} edit c={c}: {out[f'edit c={c}']}", file=sys.stderr)
        if args.load_b_requests:  # 0: the edit workload alone
            lo, hi, max_tokens, _ = LOADS["B"]
            chats = make_chats(args.load_b_requests, args.seed, lo, hi)
            before = await drafts(url) if launcher == "localserve" else (0, 0)
            results, seconds = await wave(url, model, chats, max_tokens, bias, 8)
            after = await drafts(url) if launcher == "localserve" else (0, 0)
            out["load B c=8"] = summary(results, seconds) | {"drafted": after[0] - before[0], "accepted": after[1] - before[1]}
            print(f"{name} load B: {out['load B c=8']}", file=sys.stderr)
    finally:
        stop(proc)
    return out


FIGURES = ("output_tok_s", "decode_tok_s_per_request", "decode_tok_s_all", "ttft_ms_p50", "copied", "drafted",
           "accepted")


def cell(values: list[Any], key: str) -> str:
    """One figure over the passes: the median, then each pass in order when there are several."""
    if not isinstance(values[0], float):
        return " / ".join(map(str, values))
    fmt = f"{{:.{2 if key == 'copied' else 1}f}}"
    median = fmt.format(statistics.median(values))
    return median if len(values) == 1 else f"{median} ({', '.join(fmt.format(v) for v in values)})"


def print_table(passes: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    workloads = [f"edit c={c}" for c in args.concurrency] + (["load B c=8"] if args.load_b_requests else [])
    names = list(passes)
    print("| workload | figure | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for w in workloads:
        for key in FIGURES:
            if key in passes[names[0]][0][w]:
                print(f"| {w} | {key} | " + " | ".join(cell([p[w][key] for p in passes[n]], key) for n in names) + " |")
    if "localserve" in passes and "localserve-off" in passes:
        for c in args.concurrency:
            pairs = [(a, b) for on, off in zip(passes["localserve"], passes["localserve-off"])
                     for a, b in zip(on[f"texts c={c}"], off[f"texts c={c}"])]
            same = sum(a == b for a, b in pairs)
            print(f"localserve edit answers with speculation equal to those without, c={c}: {same} of {len(pairs)}")


async def main_async(args: argparse.Namespace) -> None:
    # Read once, before any server starts: a missing commit stops the run without leaving one behind.
    sources = [read_source(f) for f in args.files]
    work = Path(tempfile.mkdtemp(prefix="localserve-spec-"))
    passes: dict[str, list[dict[str, Any]]] = {name: [] for name in args.servers}
    try:
        for i in range(args.passes):  # alternating: A B A B, so a slow spell of the machine hits both
            for name in args.servers:
                run_dir = work / f"{name}-{i}"
                run_dir.mkdir()
                passes[name].append(await bench_server(name, args, run_dir, sources))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(passes, args)
    if args.json:
        Path(args.json).write_text(json.dumps(passes, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--files", default=[f"{EDIT_COMMIT}:{f}" for f in EDIT_FILES],
                   type=lambda s: [x for x in s.split(",") if x],
                   help="source files to edit, comma-separated: paths, or COMMIT:PATH in this repository")
    p.add_argument("--servers", default=",".join(SERVERS), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--concurrency", default="1,4,8", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--load-b-requests", type=int, default=16, help="0 runs the edit workload alone")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=1, help="passes over the servers, alternating (default 1)")
    p.add_argument("--json", help="also write every pass's figures and answers to this file")
    args = p.parse_args(argv)
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        p.error(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
    args.model_path = args.model_path.resolve()
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
