"""Code completion while typing: FIM TTFT and cache reuse, localserve beside llama-server's /infill.

    python benchmarks/fim.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

The typing simulation (issue 23): a real source file is "typed" a few characters at a time; every
150 ms the editor sends `/infill` (with `id_slot` 0, as llama.vim does), laid out as llama.vim and
llama.vscode lay it out ("lines") or with all the text before the cursor as input_prefix
("flat"; see keystrokes()), and drops the previous request if it has not finished (closing its
connection, as llama.vscode's abort does). Each server runs it alone and while 4 chat streams run
beside it, in alternating passes (localserve, llama-server, localserve, llama-server), one server at
a time on the same cores. Printed per pass: FIM TTFT p50 / p95 of the requests that got a first
token, how many were dropped before it, and the share of prompt tokens the cache served
(`timings.cache_n` over `cache_n + prompt_n` of the requests that finished).

The model must name FIM tokens. SmolLM2 names none, so with --add-fim-tokens (the default for a
GGUF without them) the benchmark copies it with llama.cpp's FIM metadata keys pointing at special
tokens it has, with tests/fim_model.py as tests/model/test_fim.py does: both servers then build the same FIM prompts; the
completions are whatever SmolLM2 makes of them, and the timings are what is measured.

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import REPO, percentile, start_llama_server, start_localserve, stop, wait_ready  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from fim_model import with_fim_tokens  # noqa: E402  (the FIM copy of SmolLM2 the tests use)

SOURCE = REPO / "localserve" / "api" / "fim.py"  # the file being "typed"
SUFFIX_LINES = 12
CHAT_PROMPT = "Explain in a few sentences how a hash map handles collisions."


@dataclass
class Pass:
    ttfts: list[float] = field(default_factory=list)
    dropped: int = 0
    cached: int = 0
    evaluated: int = 0
    errors: int = 0

    def add(self, other: "Pass") -> None:
        self.ttfts += other.ttfts
        self.dropped += other.dropped
        self.cached += other.cached
        self.evaluated += other.evaluated
        self.errors += other.errors


def keystrokes(text: str, start: int, n: int, chars_per_key: int, layout: str) -> list[tuple[str, str, str]]:
    """(input_prefix, prompt, input_suffix) at each of n cursor positions, a few characters apart.

    "lines" is what llama.vim and llama.vscode send (fim_ctx_local): the lines above the cursor as
    input_prefix, the cursor's line so far as `prompt` (after <fim_mid>), the rest of that line and
    the next lines as input_suffix. Typing a line then changes only the prompt's end.
    "flat" puts all the text before the cursor in input_prefix, as a client of /v1/completions'
    prompt + suffix does: each keystroke changes what comes before the suffix."""
    out = []
    for i in range(n):
        cursor = start + i * chars_per_key
        line_start = text.rfind("\n", 0, cursor) + 1
        line_end = text.find("\n", cursor)
        rest = text[cursor:] if line_end < 0 else text[line_end:]
        after = "\n".join(rest.split("\n")[:SUFFIX_LINES])
        if layout == "lines":
            # The line is being typed anew: what follows the cursor is the lines below, unchanged
            # from keystroke to keystroke (moving the cursor along the finished line instead
            # would shorten the suffix at every key and recompute it, as no typist's editor does).
            out.append((text[:line_start], text[line_start:cursor], after))
        else:
            out.append((text[:cursor], "", after))
    return out


async def infill(session: aiohttp.ClientSession, url: str, model: str, fields: tuple[str, str, str],
                 n_predict: int, result: Pass) -> None:
    prefix, middle, suffix = fields
    body = {"model": model, "input_prefix": prefix, "input_suffix": suffix, "input_extra": [],
            "prompt": middle, "n_predict": n_predict, "stream": True, "cache_prompt": True, "id_slot": 0,
            "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99, "temperature": 0.0}
    start = time.perf_counter()
    first = None
    try:
        async with session.post(url + "/infill", json=body) as resp:
            if resp.status != 200:
                result.errors += 1
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                frame = json.loads(line[6:])
                if first is None and (frame.get("content") or frame.get("stop")):
                    first = time.perf_counter() - start
                    result.ttfts.append(first)
                if frame.get("stop"):
                    # From `timings`, as both servers count them alike (cache_n served, prompt_n
                    # computed); llama-server's tokens_cached also counts the last answer's tokens.
                    timings = frame.get("timings") or {}
                    result.cached += int(timings.get("cache_n", 0))
                    result.evaluated += int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
    except asyncio.CancelledError:
        if first is None:
            result.dropped += 1
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError):  # a server too busy to answer in time
        result.errors += 1


async def chat_loop(session: aiohttp.ClientSession, url: str, model: str, stop_at: asyncio.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 96,
            "stream": True, "temperature": 0.7}
    while not stop_at.is_set():
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                async for _ in resp.content:
                    if stop_at.is_set():
                        break


async def typing_pass(url: str, model: str, args: argparse.Namespace, chats: int, layout: str) -> Pass:
    text = SOURCE.read_text()
    result = Pass()
    stop_chats = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        background = [asyncio.create_task(chat_loop(session, url, model, stop_chats)) for _ in range(chats)]
        if chats:
            await asyncio.sleep(2.0)  # the chats are decoding before the typing starts
        previous: asyncio.Task | None = None
        strokes = keystrokes(text, args.start, args.keys, args.chars_per_key, layout)
        for i, fields in enumerate(strokes, 1):
            if previous is not None and not previous.done():
                previous.cancel()  # the next keystroke drops the answer nobody will see
            previous = asyncio.create_task(infill(session, url, model, fields, args.n_predict, result))
            if i % args.burst == 0:  # the user pauses: this completion is the one they wait for
                with contextlib.suppress(asyncio.CancelledError):
                    await previous
            await asyncio.sleep(args.interval_ms / 1000)
        if previous is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await previous
        stop_chats.set()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)  # before the session closes
    return result


def print_pooled(pooled: dict[tuple[str, str, str], Pass], rounds: int) -> None:
    """Every pass of a server, layout and load together: a p95 of one 60-key pass is its third
    slowest answer, so whether a line's first keystroke (a suffix recomputed, 0.6 s) falls in it
    or not decided it; pooled, and set beside the same server's own idle figure."""
    print(f"\npooled over {rounds} round(s):")
    for (name, layout, load), p in pooled.items():
        line = row(name, layout, load, p)
        idle = pooled.get((name, layout, "alone"))
        if load != "alone" and idle and idle.ttfts and p.ttfts:
            line += f"  p95 x{percentile(p.ttfts, 95) / percentile(idle.ttfts, 95):.2f} of alone"
        print(line)


def row(name: str, layout: str, load: str, p: Pass) -> str:
    head = f"{name:<13} {layout:<5} {load:<8}"
    if not p.ttfts:
        return f"{head} no request got a first token (dropped {p.dropped}, errors {p.errors})"
    share = p.cached / p.evaluated if p.evaluated else 0.0
    return (f"{head} TTFT p50 {percentile(p.ttfts, 50) * 1000:6.0f} ms  p95 "
            f"{percentile(p.ttfts, 95) * 1000:6.0f} ms  answered {len(p.ttfts):3d}  dropped {p.dropped:3d}  "
            f"errors {p.errors}  cached {share:6.1%}")


async def main_async(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="localserve-fim-bench-"))
    try:
        model_path = Path(args.model_path).resolve()
        if args.add_fim_tokens:
            model_path = with_fim_tokens(model_path, work / "fim-model.gguf")
        pooled: dict[tuple[str, str, str], Pass] = {}
        for round_no in range(args.rounds):
            for name in args.servers.split(","):
                run_dir = work / f"{name}-{round_no}"
                run_dir.mkdir()
                if name == "localserve":
                    proc, url, model = start_localserve(model_path, args.threads, args.sequences, run_dir)
                else:
                    proc, url, model = start_llama_server(model_path, args.threads, args.sequences, run_dir)
                try:
                    await wait_ready(url, "/health", proc)
                    warm = argparse.Namespace(**{**vars(args), "keys": 4})
                    await typing_pass(url, model, warm, 0, "flat")
                    for layout in args.layouts.split(","):
                        for chats in (0, 4):
                            result = await typing_pass(url, model, args, chats, layout)
                            load = "alone" if chats == 0 else "4 chats"
                            print(row(name, layout, load, result), flush=True)
                            pooled.setdefault((name, layout, load), Pass()).add(result)
                finally:
                    stop(proc)
        print_pooled(pooled, args.rounds)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="a GGUF (FIM tokens are added to a copy when it has none)")
    p.add_argument("--no-add-fim-tokens", dest="add_fim_tokens", action="store_false")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sequences", type=int, default=6, help="decoding slots on both servers (4 chats + FIM)")
    p.add_argument("--keys", type=int, default=120, help="requests per pass")
    p.add_argument("--interval-ms", type=float, default=150.0, help="time between keystroke requests")
    p.add_argument("--chars-per-key", type=int, default=3)
    p.add_argument("--burst", type=int, default=5,
                   help="keystrokes between pauses; at a pause the editor waits for its completion")
    p.add_argument("--start", type=int, default=2000, help="where in the file the cursor starts")
    p.add_argument("--n-predict", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="alternating passes per server")
    p.add_argument("--layouts", default="lines,flat", help="request layouts, comma-separated (see keystrokes())")
    p.add_argument("--servers", default="localserve,llama-server", help="comma-separated, in pass order")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
