"""`serve`, `stop`, `ps`, `run`: the commands around the daemon.

`serve` is the daemon; the others reach it over HTTP only (docs/architecture.md), starting it in the
background when this home has none running.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from contextlib import closing
from typing import Any

from ..protocol.requests import LANES
from ..desktop.client import DaemonClient
from ..config.settings import Settings
from ..desktop.daemon import death_message, ensure_daemon, find_daemon, stop_daemon
from ..server.main import run_daemon
from ..errors import DaemonError

HELP_TEXT = """Commands:
  /set temperature X   sampling temperature (0 = greedy)
  /set system TEXT     system message for this chat (clears the history)
  /clear               forget the conversation so far
  /bye                 leave (Ctrl-D works too)
  /help, /?            this help

Multi-line input: start with \"\"\" and end with \"\"\", or end a line with a backslash.
Ctrl-C stops the current answer."""


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("serve", parents=[common], help="run the daemon in the foreground")
    p.add_argument("--background", action="store_true", help=argparse.SUPPRESS)  # set by the autostart
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("stop", parents=[common], help="stop the running daemon")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to exit (default 60)")
    p.set_defaults(func=cmd_stop)

    p = subparsers.add_parser("ps", parents=[common], help="models loaded in the daemon")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ps)

    p = subparsers.add_parser("run", parents=[common], help="chat with a model (pulls it and starts the daemon if needed)")
    p.add_argument("model", nargs="?", help="model name (default: the default_model setting)")
    p.add_argument("prompt", nargs="*", help="one prompt: print the answer and exit (stdin is read when piped)")
    p.add_argument("--system", help="system message")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, help="sampling seed, for reproducible answers")
    p.add_argument("--max-tokens", type=int, help="longest answer in tokens")
    p.set_defaults(func=cmd_run)


# --- serve / stop / ps -----------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    return run_daemon(settings, background=args.background)


def cmd_stop(args: argparse.Namespace, settings: Settings) -> int:
    info = stop_daemon(settings, timeout=args.timeout)
    if info is None:
        print("localserve is not running.")
    else:
        print(f"Stopped localserve (pid {info.pid}).")
    return 0


def cmd_ps(args: argparse.Namespace, settings: Settings) -> int:
    info = find_daemon(settings)
    if info is None:
        # Starting a daemon just to report that nothing is loaded would be silly.
        if args.json:
            print("[]")
        else:
            print("localserve is not running.")
        return 0
    models = DaemonClient(info.url, api_key=settings.api_key).ps()
    if args.json:
        import json

        print(json.dumps(models, indent=2))
        return 0
    _print_ps(models)
    return 0


def _print_ps(models: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..runtime.memory import format_bytes

    if not models:
        print("No models loaded.")
        return
    table = Table(box=None, header_style="bold")
    # no_wrap: `ps` is often piped or read by scripts, where rich assumes 80 columns.
    # MEMORY: held now; AT MOST: what it may grow to as requests commit KV cells (runtime/status_rows.py).
    for column in ("NAME", "MEMORY", "AT MOST", "PROCESSOR", "CONTEXT", "RUNNING", "QUEUED i/d/b", "UNTIL", "WORKER"):
        table.add_column(column, no_wrap=True)
    for m in models:
        queued = m.get("waiting") or {}
        lanes = "/".join(str(queued.get(lane, 0)) for lane in LANES)
        held, most = _memory(m)
        table.add_row(
            str(m.get("name") or m.get("model")),
            format_bytes(held) if held else "-",
            format_bytes(most) if most else "-",
            _processor(m),
            # Tokens per request x requests decoding at once, as the engine was sized.
            f"{m['context_length']} x {m.get('max_sequences', 0)}" if m.get("context_length") else "-",
            str(m.get("running", 0)),
            lanes,
            _until(m),
            _worker(m),
        )
    console = Console()
    if not console.is_terminal:
        # Piped or captured, rich assumes 80 columns and cuts cells with "…" (a script then reads
        # "smol:late…"); the new CONTEXT and layers columns pushed rows past 80. Print full width.
        console = Console(width=200)
    console.print(table)
    for m in models:  # requests waiting for a load, and which model must drain first (runtime/swaps.py)
        if m.get("reason"):
            queued = f"{m['waiting_for_load']} waiting for a load; " if m.get("waiting_for_load") else ""
            print(f"{m.get('name') or m.get('model')} ({m.get('state')}): {queued}{m['reason']}")


def _memory(m: dict[str, Any]) -> tuple[int | None, int]:
    """(held now, at most): None held where the daemon could not measure it (an engine in its own
    process); a row without our fields (an older daemon) has only `size`, its plan."""
    if "size_held" not in m:
        return m.get("size") or 0, m.get("size") or 0
    return m["size_held"], m.get("size_max") or 0


def _worker(m: dict[str, Any]) -> str:
    """The engine's process: pid, uptime, and how often it was restarted after a crash."""
    worker, restarts = m.get("worker"), m.get("restarts") or 0
    parts = [f"pid {worker['pid']}, up {_duration(worker.get('uptime_s', 0))}"] if isinstance(worker, dict) else []
    if restarts:
        parts.append(f"{restarts} restart{'s' if restarts != 1 else ''}")
    return ", ".join(parts) or "-"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _processor(m: dict[str, Any]) -> str:
    if m.get("remote"):
        return "remote: " + ",".join(m.get("upstreams") or [])
    if m.get("state") in ("waiting", "failed"):  # not loaded: no processor
        return "-"
    size, vram = m.get("size") or 0, m.get("size_vram") or 0
    if not size or not vram:
        return "100% CPU"
    gpu = round(100 * vram / size)
    share = "100% GPU" if gpu >= 100 else f"{100 - gpu}%/{gpu}% CPU/GPU"
    layers = f" ({m['gpu_layers']}/{m['offloadable_layers']} layers)" if m.get("gpu_layers") else ""
    if m.get("gpu_layers") and m.get("moe_layers_in_ram"):
        layers += f", experts of {m['moe_layers_in_ram']} layers in RAM"
    if len(m.get("size_vram_by_device") or {}) > 1:  # a load over several GPUs: each card's share
        from ..runtime.memory import format_bytes

        layers += "; " + ", ".join(f"{name} {format_bytes(n)}" for name, n in m["size_vram_by_device"].items())
    return share + layers


def _until(m: dict[str, Any]) -> str:
    if m.get("state") in ("loading", "waiting", "failed"):  # _print_ps says why
        return str(m["state"])
    if m.get("pinned"):
        return "in use"
    expires = m.get("expires_at")
    if expires in (None, ""):
        return "forever"
    if isinstance(expires, str):
        try:
            when = datetime.datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return expires
    else:
        when = float(expires)
    left = when - time.time()
    if left > 10 * 365 * 86400:  # Ollama's way of saying "never" is a date far away
        return "forever"
    if left <= 0:
        return "now"
    if left < 90:
        return f"{left:.0f} seconds from now"
    if left < 90 * 60:
        return f"{left / 60:.0f} minutes from now"
    return f"{left / 3600:.1f} hours from now"


# --- run -------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    ref = args.model or settings.default_model
    model = ensure_model(ref, settings)
    _convert_if_planned(model, settings)
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        prompt = f"{piped.rstrip()}\n\n{prompt}" if prompt and piped.strip() else (prompt or piped)
        if not prompt.strip():
            return 0
    info = ensure_daemon(settings)
    chat = Chat(DaemonClient(info.url, api_key=settings.api_key), model, args)
    try:
        if prompt:
            chat.ask(prompt)
            return 0
        return chat.interactive()
    except DaemonError as e:
        # A stream that broke off because the daemon died says how it died, not just that it did.
        raise DaemonError(death_message(settings, info, f"answering with {model}") or str(e)) from None


def ensure_model(ref: str, settings: Settings) -> str:
    """The installed model's `name:tag`, pulled first when it is not installed yet."""
    from ..errors import ModelNotFoundError
    from ..store.cache import ModelStore

    store = ModelStore(settings)
    try:
        return store.find(ref).ref
    except ModelNotFoundError:
        pass
    from rich.console import Console

    from ..pull import pull_model
    from .models import PullDisplay

    with PullDisplay(Console(stderr=True)) as display:  # stderr: stdout carries only the answer
        pull_model(ref, settings, progress=display)
    return store.find(ref).ref


def _convert_if_planned(ref: str, settings: Settings) -> None:
    """Convert the model's GGUF to ONNX here, with a progress bar, when its load would (placement
    picked the onnx backend and the tag has no ONNX variant yet): the daemon would do it silently
    while the chat waited, minutes for a large model."""
    from ..runtime import registry
    from ..store.cache import ModelStore

    installed = ModelStore(settings).find(ref)
    if not registry.convertible(installed):  # no hardware probe (0.2 s) unless the onnx backend could take it
        return
    from ..runtime.planning import plan_model

    choice = plan_model(installed, settings).choice  # what the daemon's load will decide, memory included
    if not choice.convert:
        return
    from rich.console import Console

    from ..convert.first_use import convert_for_load
    from .convert import conversion_bar

    console = Console(stderr=True)  # stdout carries only the answer
    console.print(f"[dim]{choice.reason}[/dim]")
    with conversion_bar(installed.ref, console) as progress:
        convert_for_load(installed, settings, choice.execution_provider, progress)


class Chat:
    """One conversation with the daemon: history, options, streaming output, slash commands."""

    def __init__(self, client: DaemonClient, model: str, args: argparse.Namespace):
        self.client = client
        self.model = model
        self.system: str | None = args.system
        self.options: dict[str, Any] = {}
        if args.temperature is not None:
            self.options["temperature"] = args.temperature
        if args.seed is not None:
            self.options["seed"] = args.seed
        if args.max_tokens is not None:
            self.options["max_tokens"] = args.max_tokens
        self.history: list[dict[str, str]] = []

    def messages(self, prompt: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history, {"role": "user", "content": prompt}]

    def ask(self, prompt: str) -> str | None:
        """Stream one answer to stdout; None when interrupted with Ctrl-C (nothing is remembered)."""
        parts: list[str] = []
        stream = self.client.chat_stream(self.model, self.messages(prompt), **self.options)
        # closing(): leaving the loop early (Ctrl-C) closes the HTTP connection, which is how the
        # daemon learns to cancel the request and free its slot.
        with closing(stream):
            try:
                for delta in stream:
                    parts.append(delta)
                    sys.stdout.write(delta)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                sys.stdout.flush()
                return None
        answer = "".join(parts)
        sys.stdout.write("\n" if not answer.endswith("\n") else "")
        sys.stdout.flush()
        self.history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return answer

    def interactive(self) -> int:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # Windows
            pass
        print(f"Chatting with {self.model}. Type /? for help, /bye to leave.")
        while True:
            try:
                text = read_message()
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print("\nUse Ctrl-D or /bye to exit.")
                continue
            if text is None or not text.strip():
                continue
            if text.lstrip().startswith("/"):
                if self.command(text.strip()) == "bye":
                    return 0
                continue
            self.ask(text)

    def command(self, line: str) -> str | None:
        words = line.split(maxsplit=2)
        name = words[0].lower()
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name in ("/help", "/?"):
            print(HELP_TEXT)
        elif name == "/clear":
            self.history.clear()
            print("Cleared the conversation.")
        elif name == "/set" and len(words) >= 2 and words[1].lower() == "system":
            self.system = words[2] if len(words) > 2 else None
            self.history.clear()
            print("Set the system message." if self.system else "Removed the system message.")
        elif name == "/set" and len(words) == 3 and words[1].lower() == "temperature":
            try:
                value = float(words[2])
            except ValueError:
                value = -1.0
            if not 0.0 <= value <= 2.0:
                print("Temperature must be a number between 0 and 2.")
            else:
                self.options["temperature"] = value
                print(f"Set temperature to {value:g}.")
        else:
            print(f"Unknown command {line!r}. Type /? for help.")
        return None


def read_message() -> str | None:
    """One user message: a line, lines joined by trailing backslashes, or a \"\"\" block."""
    line = input(">>> ")
    if line.lstrip().startswith('"""'):
        body = line.lstrip()[3:]
        if body.rstrip().endswith('"""') and body.strip() != "":
            return body.rstrip()[:-3]
        lines = [body] if body else []
        while True:
            more = input("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(more)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = input("... ")
    lines.append(line)
    return "\n".join(lines)
