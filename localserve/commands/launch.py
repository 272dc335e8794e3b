"""`launch`: run a coding agent (Claude Code, Codex, opencode, aider and the rest) on a local model.

Pulls the model when it is not installed, starts the daemon when it is not running, asks the
daemon for the context the model is served with, and runs the agent with the switches that point
it here (desktop/agents.py). Arguments after `--` go to the agent unchanged.

An agent that reads its provider from a file (Claude Code's `--settings FILE`, opencode's,
Continue's, ...) gets it in a folder made for the run: the files hold the token, so they are 0600
in a 0700 folder, removed when the agent exits. So launch waits for the agent instead of becoming
it, ignoring the terminal's Ctrl-C and Ctrl-\\ as a shell does for its child.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
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
        "launch", parents=[common], help="run a coding agent (claude, codex, opencode, aider, ...) on a local model",
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
def run_files(agent: Agent, target: Target) -> Iterator[Target]:
    """The agent's files for this run in a folder only this user can read (they hold the token),
    gone when the agent exits; the target names the folder."""
    if agent.files is None:
        yield target
        return
    folder = tempfile.mkdtemp(prefix=f"localserve-{agent.name}-")  # 0700
    try:
        run_target = dataclasses.replace(target, workdir=folder)
        for name, text in agent.files(run_target).items():
            path = os.path.join(folder, name)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # Cline's settings/
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        yield run_target
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_agent(agent: Agent, executable: str, target: Target, extra: list[str]) -> int:
    with run_files(agent, target) as run_target:
        return _wait_for(agent.command(executable, run_target, extra), agent.environ(run_target, os.environ))


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
