"""`launch`: run a coding agent (Claude Code, Codex CLI, Copilot CLI) on a local model.

Pulls the model when it is not installed, starts the daemon when it is not running, asks the
daemon for the context the model is served with, and runs the agent with the switches that point
it here (desktop/agents.py). Arguments after `--` go to the agent unchanged.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..config.settings import Settings
from ..desktop.agents import AGENTS, NO_KEY_TOKEN, Agent, Target, context_warning
from ..desktop.client import DaemonClient
from ..desktop.daemon import ensure_daemon
from ..errors import LocalserveError
from .daemon import ensure_model


class AgentNotInstalledError(LocalserveError):
    pass


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
    model = ensure_model(args.model or settings.default_model, settings)
    info = ensure_daemon(settings)
    client = DaemonClient(info.url, api_key=settings.api_key)
    target = Target(info.url.rstrip("/"), settings.api_key or NO_KEY_TOKEN, model, served_context(client, model))
    warning = context_warning(agent, target)
    if warning:
        print(warning, file=sys.stderr)
    return run_agent(agent, executable, target, args.passthrough)


def run_agent(agent: Agent, executable: str, target: Target, extra: list[str]) -> int:
    environ = {**os.environ, **agent.environment(target)}
    command = agent.command(executable, target, extra)
    if sys.platform != "win32":
        # The agent takes over the terminal (its TUI, Ctrl-C, its exit status) as if started by
        # hand; a Python parent in between would catch the terminal's signals too.
        os.execve(executable, command, environ)
    return subprocess.call(command, env=environ)
