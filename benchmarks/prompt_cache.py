"""The prompt cache on disk as issue 42 measures it, on a real daemon: an agent-shaped conversation
(a ~20k-token system prompt of tool descriptions, then a question) on Gemma 3 270M with its 32k
context is answered cold; then its next turn is asked after each way a model's memory goes away:

- restart: the daemon stopped (Ctrl-C) and started again;
- unload: the model unloaded by an Ollama `keep_alive: 0` request, as the keep_alive timer does;
- kill: the engine worker SIGKILLed (nothing can be written at the end: the file is the one its
  idle engine wrote).

Each next turn's TTFT is printed beside the cold turn's (target: <= 15%), with its cached_tokens.
llama-server keeps no cache across a restart: its figure is the same next turn sent to a freshly
started llama-server, a cold prefill, for the user's other choice. Figures, not assertions.

    .venv/bin/python benchmarks/prompt_cache.py [--model-path GGUF] [--tokens 20000] [--no-llama-server]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (REPO, localserve_env, serve_localserve, start_llama_server, start_localserve,  # noqa: E402
                   stop, stream_chat, wait_ready)

GEMMA3 = REPO / ".test-cache/home/models/gemma3-270m/Q4_K_M/gemma-3-270m-q4_k_m.gguf"
MODEL = "bench"
CONTEXT = 32768
TOOL = ("Tool {n}: `{name}` takes a path and an optional range of lines, reads the file from the "
        "workspace, and returns its text with line numbers; it refuses binary files, paths outside the "
        "workspace and files over the size limit, and says which. ")
NAMES = ("read_file", "grep", "list_dir", "apply_patch", "run_tests", "shell", "web_fetch", "todo_write")
AFTER = {"restart": "after a daemon restart", "unload": "after an unload (keep_alive 0)",
         "kill": "after a SIGKILLed worker"}
QUESTIONS = ("Which tool reads a file?", "And which one runs the tests?", "Can grep search binary files?",
             "Summarise the tools in one line.")


async def serve(env: dict[str, str], work: Path) -> tuple[subprocess.Popen[bytes], str]:
    proc, url = serve_localserve(env, work)
    await wait_ready(url, "/health", proc)
    return proc, url


async def post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            raise SystemExit(f"{path}: HTTP {resp.status}: {answer}")
        return answer


async def turn(url: str, messages: list[dict[str, str]]) -> dict:
    """One streamed, greedy turn: its TTFT, its text and its usage."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        answer = await stream_chat(session, url, body)
    usage = answer["usage"]
    return {"ttft": answer["ttft"], "text": answer["text"], "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def parked_files(home: Path) -> set[Path]:
    return set((home / "prompt-cache").glob("*/*.kv"))


async def wait_for_new_file(home: Path, before: set[Path], timeout: float = 120) -> None:
    """The parked conversation is written once it stays parked a few seconds with the engine idle."""
    deadline = time.monotonic() + timeout
    while not parked_files(home) - before:
        if time.monotonic() > deadline:
            raise SystemExit("the conversation was never written to the prompt cache")
        await asyncio.sleep(0.2)


async def system_prompt(url: str, tokens: int) -> str:
    """Tool descriptions, cut to about `tokens` tokens by the daemon's own /tokenize."""
    text = "".join(TOOL.format(n=n, name=NAMES[n % len(NAMES)] + f"_{n}") for n in range(tokens // 40))
    count = len((await post(url, "/tokenize", {"model": MODEL, "content": text}))["tokens"])
    return text[: int(len(text) * min(1.0, tokens / count))]


def next_turn(conversation: list[dict[str, str]], answer: str, question: str) -> list[dict[str, str]]:
    return conversation + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def show(name: str, t: dict, cold: float) -> None:
    print(f"{name:42} {t['prompt_tokens']:>7} {t['cached']:>8} {t['ttft']:>8.2f} {100 * t['ttft'] / cold:>9.1f}%",
          flush=True)


async def localserve_turns(model_path: Path, args: argparse.Namespace, work: Path) -> list[dict[str, str]]:
    extra = {"LOCALSERVE_CONTEXT_LENGTH": str(CONTEXT)}
    env = localserve_env(args.threads, 2, work, extra)
    home = work / "home"
    print(f"{'localserve, turn':42} {'prompt':>7} {'cached':>8} {'TTFT s':>8} {'of cold':>10}", flush=True)
    proc, url, _ = start_localserve(model_path, args.threads, 2, work, extra)
    await wait_ready(url, "/health", proc)
    try:
        conversation = [{"role": "system", "content": await system_prompt(url, args.tokens)},
                        {"role": "user", "content": QUESTIONS[0]}]
        first = await turn(url, conversation)
        cold = first["ttft"]
        show("1, cold", first, cold)
        answer = first["text"]
        await wait_for_new_file(home, set())
        stop(proc)

        proc, url = await serve(env, work)
        for n, (why, question) in enumerate(zip(AFTER, QUESTIONS[1:]), start=2):
            if why == "unload":
                await post(url, "/api/generate", {"model": MODEL, "keep_alive": 0})
            elif why == "kill":
                (worker,) = [w for child in psutil.Process(proc.pid).children() for w in child.children()]
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(10)
            conversation = next_turn(conversation, answer, question)
            before = parked_files(home)
            t = await turn(url, conversation)
            show(f"{n}, {AFTER[why]}", t, cold)
            answer = t["text"]
            await wait_for_new_file(home, before)
        return conversation
    finally:
        stop(proc)


async def llama_server_turn(model_path: Path, conversation: list[dict[str, str]], args: argparse.Namespace,
                            work: Path) -> None:
    proc, url, _ = start_llama_server(model_path, args.threads, 2, work, slot_ctx=CONTEXT)
    try:
        await wait_ready(url, "/health", proc)
        t = await turn(url, conversation)
        print(f"{'llama-server, the last turn after a restart':42} {t['prompt_tokens']:>7} {t['cached']:>8} "
              f"{t['ttft']:>8.2f}", flush=True)
    finally:
        stop(proc)


async def main_async(args: argparse.Namespace) -> None:
    model_path = Path(args.model_path).resolve()
    work = Path(tempfile.mkdtemp(prefix="localserve-prompt-cache-"))
    conversation = await localserve_turns(model_path, args, work)
    if args.llama_server:
        await llama_server_turn(model_path, conversation, args, work)
    print(f"(logs in {work})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=str(GEMMA3), help="the GGUF (default: the tests' Gemma 3 270M)")
    p.add_argument("--tokens", type=int, default=20000, help="the system prompt's tokens (default 20,000)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama-server", dest="llama_server", action="store_false")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
