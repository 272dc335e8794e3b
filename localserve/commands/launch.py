"""`launch`: run a coding agent (Claude Code, Codex CLI, Copilot CLI) on a local model.

Pulls the model when it is not installed, starts the daemon when it is not running, asks the
daemon for the context the model is served with, and runs the agent with the switches that point
it here (desktop/agents.py). Arguments after `--` go to the agent unchanged.

Claude Code's switches go in a settings file of its own (`--settings FILE`), which holds the
token: the file is made 0600 and removed when the agent exits, so launch waits for the agent
instead of becoming it, ignoring the terminal's Ctrl-C and Ctrl-\\ as a shell does for its child.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Iterator

from ..config.settings import Settings
from ..desktop.agents import AGENTS, NO_KEY_TOKEN, Agent, Target, context_warning
from ..desktop.client import DaemonClient
from ..desktop.daemon import ensure_daemon
from ..errors import LocalserveError
from .daemon import ensure_model


class AgentNotInstalledError(LocalserveError):
    pass


class AgentOverriddenError(LocalserveError):
    """The agent's own configuration would send the session somewhere other than the daemon."""


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "launch", parents=[common], help="run a coding agent (claude, codex, copilot) on a local model",
        description="Run a coding agent on a local model. Arguments after `--` are passed to the agent, "
                    "e.g. `localserve launch claude -- -p 'explain main.py'`.")
    p.add_argument("agent", choices=sorted(AGENTS), help="the agent to run")
    p.add_argument("model", nargs="?", help="model name (default: the default_model setting)")
    p.set_defaults(func=cmd_launch, passthrough=[])


def served_context(client: DaemonClient, model: str) -> int:
    """The context each request gets, as /api/show reports it to every Ollama client."""
    info = client.request_json("POST", "/api/show", {"model": model}).get("model_info", {})
    return next(int(value) for key, value in info.items() if key.endswith(".context_length"))


def cmd_launch(args: argparse.Namespace, settings: Settings) -> int:
    agent = AGENTS[args.agent]
    executable = agent.find()
    if executable is None:
        raise AgentNotInstalledError(f"{agent.title} is not installed (no `{agent.executable}` on PATH); "
                                     f"install it with: {agent.install}")
    refuse_overrides(agent)
    model = ensure_model(args.model or settings.default_model, settings)
    info = ensure_daemon(settings)
    client = DaemonClient(info.url, api_key=settings.api_key)
    target = Target(info.url.rstrip("/"), settings.api_key or NO_KEY_TOKEN, model, served_context(client, model))
    warning = context_warning(agent, target)
    if warning:
        print(warning, file=sys.stderr)
    return run_agent(agent, executable, target, args.passthrough)


def refuse_overrides(agent: Agent) -> None:
    """Before anything starts: settings of the agent's own that outrank every switch launch has
    (Claude Code's managed settings) would send the session, and the key, elsewhere."""
    found = agent.overrides()
    if found:
        raise AgentOverriddenError(
            f"{agent.title}'s managed settings say where it sends requests, and they outrank anything "
            f"`localserve launch` can pass ({'; '.join(found)}): the session would not run on localserve. "
            "Ask whoever manages them to leave these out.")


@contextlib.contextmanager
def settings_file(agent: Agent, target: Target) -> Iterator[str | None]:
    """The agent's settings for this run in a file only this user can read, gone afterwards."""
    if agent.settings is None:
        yield None
        return
    fd, path = tempfile.mkstemp(prefix=f"localserve-{agent.name}-", suffix=".json")  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(agent.settings(target), f)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run_agent(agent: Agent, executable: str, target: Target, extra: list[str]) -> int:
    environ = agent.environ(target, os.environ)
    with settings_file(agent, target) as path:
        return _wait_for(agent.command(executable, target, extra, path), environ)


def _wait_for(command: list[str], environ: dict[str, str]) -> int:
    """Run the agent in the foreground and return its exit status, as a shell would: the terminal's
    Ctrl-C and Ctrl-\\ reach the agent (same process group) and are ignored here; a hangup or a
    TERM sent to launch is passed on, and launch cleans up once the agent is gone."""
    if sys.platform == "win32":
        return subprocess.call(command, env=environ)
    child = subprocess.Popen(command, env=environ)
    passed_on = {sig: signal.signal(sig, lambda s, _frame: child.send_signal(s))
                 for sig in (signal.SIGTERM, signal.SIGHUP)}
    ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:
        status = child.wait()
    finally:
        for sig, previous in {**passed_on, **ignored}.items():
            signal.signal(sig, previous)
    return 128 - status if status < 0 else status  # killed by a signal: the shell's 128+N
