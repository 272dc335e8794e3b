"""Short requests beside agent turns (issue 48), localserve and llama-server `-np 8 -fa off` on the
same GGUF, in alternating passes:

    flock /tmp/team/bench.lock .venv/bin/python benchmarks/agent_side.py \
        --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

(a) a long prompt, then 1 s later a short one, in the same lane: each one's TTFT beside its TTFT
    alone; (b) six agent-shaped requests and four short side requests at once: whether every side
    request was answered before any agent turn, errors, total time.

SmolLM2 holds 8k tokens per sequence: the issue's 7,500-token prompt fits, its 5-14k agent turns
are scaled to 2.5-7k (--agent-scale). Figures, not assertions (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import WORDS, FA_OFF, READY, Result, eog_bias, one_request, start_llama_server, start_localserve, stop, wait_ready  # noqa: E402

AGENT_TOKENS = (5000, 7000, 9000, 11000, 12500, 14000)
SIDE_TOKENS = 600


def prompt_of(tokens: int, tag: str) -> str:
    """About `tokens` tokens of text (~1.3 tokens a word), starting with `tag` so no prefix is shared."""
    words = [WORDS[(i * 7) % len(WORDS)] for i in range(int(tokens / 1.3))]
    return f"{tag}: " + " ".join(words) + ". Summarize this in one line."


async def ask(url: str, model: str, text: str, max_tokens: int, bias: dict[str, float]) -> tuple[Result, float]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias}
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        result = await one_request(session, url, body, {})
    return result, time.perf_counter()


async def case_a(url: str, model: str, args: argparse.Namespace, bias: dict[str, float]) -> dict[str, float]:
    # The runs alone start differently: a shared start would be served from the prefix cache.
    long_text, short_text = prompt_of(args.long_tokens, "long"), prompt_of(SIDE_TOKENS, "short")
    long_alone, _ = await ask(url, model, prompt_of(args.long_tokens, "alone long"), 8, bias)
    short_alone, _ = await ask(url, model, prompt_of(SIDE_TOKENS, "alone short"), 8, bias)
    long_task = asyncio.create_task(ask(url, model, long_text, 8, bias))
    await asyncio.sleep(1.0)
    short, _ = await ask(url, model, short_text, 8, bias)
    long, _ = await long_task
    return {"long_alone_ttft_s": long_alone.ttft, "short_alone_ttft_s": short_alone.ttft,
            "short_behind_ttft_s": short.ttft, "long_with_short_ttft_s": long.ttft,
            "short_x_alone": short.ttft / short_alone.ttft, "long_x_alone": long.ttft / long_alone.ttft}


async def case_b(url: str, model: str, args: argparse.Namespace, bias: dict[str, float]) -> dict[str, float]:
    start = time.perf_counter()
    agents = [asyncio.create_task(ask(url, model, prompt_of(int(n * args.agent_scale), f"agent {i}"), 32, bias))
              for i, n in enumerate(AGENT_TOKENS)]
    sides = [asyncio.create_task(ask(url, model, prompt_of(SIDE_TOKENS, f"side {i}"), 16, bias)) for i in range(4)]
    agent_done = await asyncio.gather(*agents)
    side_done = await asyncio.gather(*sides)
    errors = [r.error for r, _ in agent_done + side_done if not r.ok]
    return {"sides_before_agents": float(max(t for _, t in side_done) < min(t for _, t in agent_done)),
            "errors": float(len(errors)), "total_s": time.perf_counter() - start,
            "side_ttft_max_s": max(r.ttft for r, _ in side_done)}


async def one_pass(name: str, args: argparse.Namespace, work: Path, bias: dict[str, float]) -> dict[str, float]:
    model_path = Path(args.model_path).resolve()
    if name == "localserve":
        proc, url, model = start_localserve(model_path, args.threads, 8, work)
    else:
        proc, url, model = start_llama_server(model_path, args.threads, 8, work, extra_args=["-fa", "off"],
                                              slot_ctx=8192)
    try:
        await wait_ready(url, READY[name], proc)
        await ask(url, model, "Hello", 4, bias)  # loads the model outside the measurement
        figures = await case_a(url, model, args, bias) if "a" in args.cases else {}
        if "b" in args.cases:
            figures |= {f"b_{k}": v for k, v in (await case_b(url, model, args, bias)).items()}
        return figures
    finally:
        stop(proc)


async def main(args: argparse.Namespace) -> None:
    bias = eog_bias(Path(args.model_path))
    work = Path(tempfile.mkdtemp(prefix="agent-side-"))
    columns: list[tuple[str, dict[str, float]]] = []
    try:
        for n in range(1, args.passes + 1):
            for name in ("localserve", FA_OFF):
                run_dir = work / f"{name}-{n}"
                run_dir.mkdir()
                columns.append((f"{name} #{n}", await one_pass(name, args, run_dir, bias)))
                print(f"pass {n} {name}: {columns[-1][1]}", file=sys.stderr)  # kept if a later pass dies
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = list(columns[0][1])
    print("".ljust(28) + "".join(c.rjust(26) for c, _ in columns))
    for key in keys:
        print(key.ljust(28) + "".join(f"{v[key]:.3f}".rjust(26) for _, v in columns))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--cases", default="ab", help="which cases to run: a, b or ab (default)")
    p.add_argument("--long-tokens", type=int, default=7500)
    p.add_argument("--agent-scale", type=float, default=0.5, help="agent turns' share of 5-14k tokens (8k context)")
    asyncio.run(main(p.parse_args()))
